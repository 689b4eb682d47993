"""`--limit-mm-per-prompt`: the most items of each modality one prompt may carry, in vLLM's
two spellings (JSON `{"image": 2}` or `image=2,video=0`)."""

from __future__ import annotations

import json
from typing import Any

# The modalities this engine takes; vLLM's others are refused by name rather than ignored.
MODALITIES = ("image",)
KNOWN_ELSEWHERE = ("video", "audio")


def parse_mm_limits(value: dict[str, Any] | str | None) -> dict[str, int] | None:
    """A flag's text, or a dict (LLM(...), YAML) -> {modality: most items per prompt}."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _parse_text(value)
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must map modalities to counts, e.g. "
                         f"'{{\"image\": 2}}' or 'image=2', got {value!r}")
    limits: dict[str, int] = {}
    for name, count in value.items():
        if name in KNOWN_ELSEWHERE and count == 0:
            continue  # none is what this engine takes anyway
        if name in KNOWN_ELSEWHERE:
            raise ValueError(f"limit_mm_per_prompt: {name} inputs are not supported (this "
                             f"engine takes images only)")
        if name not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {name!r} (known: "
                             f"{', '.join(MODALITIES)})")
        if isinstance(count, dict):  # vLLM's newer {"image": {"count": N}} spelling
            unknown = sorted(set(count) - {"count"})
            if unknown or "count" not in count:
                raise ValueError(f"limit_mm_per_prompt: {name} takes {{\"count\": N}} (vLLM's "
                                 f"profiling sizes are not used here), got {count!r}")
            count = count["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt: {name} must be a count >= 0, got {count!r}")
        limits[name] = count
    return limits


def _parse_text(text: str) -> Any:
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {exc}") from None
    pairs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.partition("=")
        if not sep:
            raise ValueError(f"limit_mm_per_prompt: {item!r} is not MODALITY=COUNT (e.g. "
                             "image=2) nor JSON")
        try:
            pairs[name.strip()] = int(count)
        except ValueError:
            raise ValueError(f"limit_mm_per_prompt: {name.strip()} must be a count >= 0, got "
                             f"{count.strip()!r}") from None
    return pairs
