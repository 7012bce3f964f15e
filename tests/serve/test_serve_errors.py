"""Bad requests get the right status and an OpenAI-style error object, and the server keeps
serving: same output as before them, every KV block free."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "Hello world", "max_tokens": 6, "temperature": 0}
USER = [{"role": "user", "content": "Hello"}]
OK_CHAT = {"model": "tiny", "messages": USER, "max_tokens": 6}


def completion(**changes) -> dict:
    body = {**OK, **changes}
    return {k: v for k, v in body.items() if v is not ...}  # ... drops a field


def chat(**changes) -> dict:
    body = {**OK_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def json_schema(schema: dict) -> dict:
    """A response_format asking for documents of schema."""
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (path, JSON body or raw bytes, status, text the message must contain)
BAD_REQUESTS = {
    # each sampling field out of range: SamplingParams' own one-line message
    "temperature<0": (COMPLETIONS, completion(temperature=-0.5), 400, "temperature=-0.5 is out"),
    "top_p=0": (COMPLETIONS, completion(top_p=0.0), 400, "top_p=0.0 is out of range"),
    "top_p>1": (COMPLETIONS, completion(top_p=1.5), 400, "top_p=1.5 is out of range"),
    "top_k=-2": (COMPLETIONS, completion(top_k=-2), 400, "top_k=-2 is out of range"),
    "min_p>1": (COMPLETIONS, completion(min_p=2.0), 400, "min_p=2.0 is out of range"),
    "repetition_penalty=0": (
        COMPLETIONS,
        completion(repetition_penalty=0.0),
        400,
        "repetition_penalty=0.0 is out",
    ),
    "presence_penalty>2": (
        COMPLETIONS,
        completion(presence_penalty=2.5),
        400,
        "presence_penalty=2.5 is out",
    ),
    "frequency_penalty<-2": (
        COMPLETIONS,
        completion(frequency_penalty=-3.0),
        400,
        "frequency_penalty=-3.0 is out",
    ),
    "max_tokens=0": (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens=0 is out of range"),
    "min_tokens>max_tokens": (
        COMPLETIONS,
        completion(min_tokens=7),
        400,
        "min_tokens=7 is out of range",
    ),
    "seed<0": (COMPLETIONS, completion(seed=-1), 400, "seed=-1 is out of range"),
    "n=0": (COMPLETIONS, completion(n=0), 400, "n=0 is out of range"),
    "n=1000": (COMPLETIONS, completion(n=1000), 400, "n=1000 is out of range"),
    "logprobs=21": (COMPLETIONS, completion(logprobs=21), 400, "logprobs=21 is out of range"),
    "top_logprobs=21": (
        CHAT,
        chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs=21 is out of range",
    ),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "needs logprobs: true"),
    "empty stop string": (
        COMPLETIONS,
        completion(stop=[""]),
        400,
        "stop=[''] holds an empty string",
    ),
    "stop token id out of vocab": (
        COMPLETIONS,
        completion(stop_token_ids=[10**6]),
        400,
        "token id 1000000 is out of range",
    ),
    # wrong types
    "temperature string": (
        COMPLETIONS,
        completion(temperature="hot"),
        400,
        "temperature: Input should be a valid",
    ),
    "max_tokens float": (COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens: Input"),
    "n bool": (COMPLETIONS, completion(n=True), 400, "n: Input should be a valid integer"),
    # a union's deepest complaint: what is wrong in the part, not that it is not a string
    "image part": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content.0.type: Input should be 'text'",
    ),
    "stream string": (COMPLETIONS, completion(stream="yes"), 400, "stream: Input"),
    "stop number": (COMPLETIONS, completion(stop=123), 400, "stop"),
    "prompt number": (COMPLETIONS, completion(prompt=5), 400, "prompt"),
    "prompt float ids": (COMPLETIONS, completion(prompt=[1.5, 2]), 400, "prompt"),
    "messages string": (CHAT, chat(messages="hi"), 400, "messages"),
    "message role tool": (
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages[0] is a tool result with no tool call to answer",
    ),
    "image content": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content",
    ),
    "stream_options not an object": (
        COMPLETIONS,
        completion(stream_options=True),
        400,
        "stream_options",
    ),
    # missing or empty fields
    "prompt missing": (COMPLETIONS, completion(prompt=...), 400, "prompt is missing"),
    "messages missing": (CHAT, chat(messages=...), 400, "messages is missing"),
    "role missing": (CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role is missing"),
    "messages empty": (CHAT, chat(messages=[]), 400, "messages is empty"),
    "prompt empty string": (COMPLETIONS, completion(prompt=""), 400, "prompt is empty"),
    "prompt empty list": (COMPLETIONS, completion(prompt=[]), 400, "prompt is empty"),
    # prompts the model cannot take
    "token id out of vocab": (
        COMPLETIONS,
        completion(prompt=[1, 99999]),
        400,
        "prompt=[1, 99999] holds the token id 99999: allowed",
    ),
    "prompt over the context": (
        COMPLETIONS,
        completion(prompt=[5] * 2048),
        400,
        "the prompt has 2048 tokens",
    ),
    "prompt + max_tokens over the context": (
        COMPLETIONS,
        completion(prompt=[5] * 2000, max_tokens=100),
        400,
        "together 2100",
    ),
    # unsupported features, not silently ignored
    "echo with chat": (CHAT, chat(echo=True), 400, "echo=True is for /v1/completions only"),
    "max_tokens 0 without echo": (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens=0"),
    # tools and structured output
    "tool without function": (CHAT, chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    "tool result answering no call": (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c2", "content": "x"},
            ]
        ),
        400,
        "messages[2].tool_call_id='c2' matches no unanswered call",
    ),
    "unknown tool in tool_choice": (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice.function.name='g' is not one of the tools: allowed f",
    ),
    "invalid schema": (
        CHAT,
        chat(response_format=json_schema({"type": "object", "properties": {"a": {"type": 5}}})),
        400,
        "response_format.json_schema.schema.properties.a.type is not a valid JSON schema",
    ),
    "schema feature the engine cannot enforce": (
        CHAT,
        chat(response_format=json_schema({"type": "array", "items": {"not": {"type": "null"}}})),
        400,
        "response_format.json_schema.schema.items.not: `not` (a negated schema) cannot be enforced",
    ),
    "regex that does not compile": (
        COMPLETIONS,
        completion(structured_outputs={"regex": "(a"}),
        400,
        "structured_output.regex cannot be compiled: Regex parsing error",
    ),
    # the body itself
    "malformed JSON": (COMPLETIONS, b'{"prompt": "x", ', 400, "not valid JSON"),
    "temperature Infinity": (
        COMPLETIONS,
        b'{"prompt": "x", "temperature": Infinity}',
        400,
        "temperature: Input",
    ),
    "top_p NaN": (COMPLETIONS, b'{"prompt": "x", "top_p": NaN}', 400, "top_p: Input"),
    "body is a list": (COMPLETIONS, b"[1, 2]", 400, "the body must be a JSON object"),
    "oversize body": (COMPLETIONS, completion(prompt="x" * 30000), 413, "over the limit"),
    "unknown model": (COMPLETIONS, completion(model="gpt-4"), 404, "`gpt-4` does not exist"),
    "unknown chat model": (CHAT, chat(model="gpt-4"), 404, "`gpt-4` does not exist"),
}


@pytest.fixture(scope="module")
def http(strict_server, api_key):
    with httpx.Client(
        base_url=strict_server.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http) -> dict:
    """A normal request's answer before any bad one."""
    response = http.post(COMPLETIONS, json=OK)
    assert response.status_code == 200
    return response.json()["choices"][0]


def check_error(response: httpx.Response, status: int, text: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text in error["message"], error["message"]
    assert "\n" not in error["message"]
    return error


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request(http, reference, case):
    path, body, status, text = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    error = check_error(response, status, text)
    if status == 400:
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        ("application/json; charset=utf-8", True),
        ("application/vnd.api+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
    ],
)
def test_the_body_is_json_only_when_the_content_type_says_so(http, reference, content_type, ok):
    headers = {"Content-Type": content_type}
    response = http.post(COMPLETIONS, content=json.dumps(OK), headers=headers)
    if ok:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0] == reference
    else:
        check_error(response, 400, "the body must be a JSON object")


def test_out_of_range_fields_name_the_parameter(http):
    error = check_error(http.post(COMPLETIONS, json=completion(top_p=0.0)), 400, "top_p")
    assert error["param"] == "top_p"
    error = check_error(http.post(COMPLETIONS, json=completion(model="x")), 404, "x")
    assert (error["param"], error["code"], error["type"]) == (
        "model",
        "model_not_found",
        "not_found_error",
    )


def test_chunked_body_over_the_limit(http):
    def pieces():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 4000
        yield b'"}'

    response = http.post(
        COMPLETIONS, content=pieces(), headers={"Content-Type": "application/json"}
    )
    check_error(response, 413, "over the limit of 20000 bytes")


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}]
)
def test_missing_or_wrong_key(strict_server, headers):
    for path in (COMPLETIONS, "/v1/models"):
        response = httpx.post(f"{strict_server.url}{path}", json=OK, headers=headers)
        error = check_error(response, 401, "API key")
        assert error["type"] == "authentication_error"
    for path in ("/health", "/metrics", "/version"):  # open without a key
        assert httpx.get(f"{strict_server.url}{path}").status_code == 200


def test_openai_client_sees_typed_errors(strict_server, api_key):
    url = f"{strict_server.url}/v1"
    good = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature=-1.0 is out of range"):
        good.completions.create(model="tiny", prompt="x", temperature=-1.0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        good.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="bad", max_retries=0).models.list()


def test_wrong_method_and_unknown_path(http):
    check_error(http.get(COMPLETIONS), 405, "Method Not Allowed")
    check_error(http.get("/v1/nothing"), 404, "Not Found")


def test_server_still_serves_after_bad_requests(strict_server, http, reference):
    for path, body, _, _ in BAD_REQUESTS.values():
        if isinstance(body, bytes):
            http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            http.post(path, json=body)
    again = http.post(COMPLETIONS, json=OK)
    assert again.status_code == 200 and again.json()["choices"][0] == reference
    streamed = http.post(COMPLETIONS, json={**OK, "stream": True})
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == reference["text"]
    strict_server.wait_idle()
    assert "Traceback" not in strict_server.log()
