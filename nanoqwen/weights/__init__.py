"""Readers: where a model is (hub.py), its tokenizer and chat template, GGUF files, and
generation defaults."""
