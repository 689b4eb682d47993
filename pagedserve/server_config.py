"""What only `pagedserve serve` uses: the HTTP server's settings, as flags (`arg_utils`) and
keywords, from the same `setting` fields as the engine's (config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import setting


@dataclass
class ServerConfig:
    """What only `pagedserve serve` uses."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on the API routes (default: "
              "$PAGEDSERVE_API_KEY; /health, /version and /metrics stay open)")
    served_model_name: str | None = setting(
        None, "the model's name in the API (default: the model's file or directory name)")
    max_waiting_requests: int = setting(4096, "answer 503 while this many requests wait to be "
                                              "scheduled")
    max_n: int = setting(128, "most sequences per prompt (n) and prompts per request, as "
                              "OpenAI caps them")
    max_request_body_bytes: int | None = setting(
        None, "answer 413 to a larger body, before parsing it (default: 64 bytes per token of "
              "max_model_len, at least 4 MiB, or 64 MiB for a model that takes images)")
    shutdown_timeout: float = setting(30.0, "on SIGTERM or SIGINT, seconds running requests "
                                            "may finish in before they end with an error; a "
                                            "second signal exits at once")
    uvicorn_log_level: str = setting("warning", "uvicorn's own log level")
    tool_call_parser: str | None = setting(
        None, "how the model writes tool calls, for tool_choice 'auto' (required and named "
              "choices need none)", choices=["hermes", "smollm2", "llama3_json"])
    enable_auto_tool_choice: bool = setting(
        False, "vLLM's flag: tool_choice 'auto' needs --tool-call-parser, which turns it on "
               "by itself here", hidden=True)
    reasoning_parser: str | None = setting(
        None, "split <think>...</think> into reasoning_content",
        choices=["qwen3", "think", "deepseek_r1"])
    enable_log_requests: bool = setting(True, "log a line per finished request "
                                              "(--disable-log-requests turns it off)")
    responses_store_size: int = setting(
        1000, "most responses /v1/responses keeps in memory for previous_response_id and GET "
              "(the least recently used go first; 0 stores none)")
    responses_store_bytes: int = setting(
        1 << 30, "most characters of text those stored responses may hold, images' data URLs "
                 "included (the least recently used go first; a larger response is not "
                 "stored)")
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    enable_chat_page: bool = setting(True, "serve the chat page at / (--disable-chat-page "
                                           "turns it off)")
    allowed_local_media_path: str | None = setting(
        None, "a directory whose image files requests may name (file:// URLs or absolute "
              "paths, symlinks resolved first); default: none, only data: URLs. Remote URLs "
              "are never fetched")
    max_image_pixels: int = setting(
        32 << 20, "refuse an image with more pixels (width x height, read from its header "
                  "before decoding) with a 400")
    media_workers: int | None = setting(
        None, "threads that decode images and run the model's image processor, off the event "
              "loop and the engine's steps (default: the CPU count, at most 8)")
    enable_mm_embeds: bool = setting(
        False, "take image_embeds content parts (precomputed embeddings); for trusted "
               "clients only")

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, "
                             "smollm2 or llama3_json) to read the model's tool calls")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {self.port}")
        for name in ("max_waiting_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got "
                             f"{self.max_request_body_bytes}")
        if not self.shutdown_timeout >= 0:  # NaN too
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got "
                             f"{self.shutdown_timeout}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got "
                             f"{self.responses_store_size}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got "
                             f"{self.responses_store_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.media_workers is not None and self.media_workers < 1:
            raise ValueError(f"media_workers must be >= 1, got {self.media_workers}")
        if self.allowed_local_media_path is not None \
                and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is "
                             "not a directory")
