"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), translated onto
the chat path: a request becomes a chat completion request (template, tools, grammar), the
chat parser's output becomes content blocks, and errors take Anthropic's shape."""
