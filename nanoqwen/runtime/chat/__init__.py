"""Chat: OpenAI-style messages, tools and response formats in; assistant messages out."""
