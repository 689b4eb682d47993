"""LoRA adapters in the API: the cards /v1/models lists for them, and vLLM's
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` behind
--allow-runtime-lora-updating (errors in OpenAI's shape)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pagedserve.server import protocol as p
from pagedserve.server.common import ApiError, ServerState


class LoadLoRAAdapterRequest(p.OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(p.OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None


def adapter_cards(state: ServerState, created: int) -> list[p.ModelCard]:
    if state.loras is None:
        return []
    return [p.ModelCard(id=name, created=created, root=served.request.lora_path,
                        parent=served.parent or state.model_name)
            for name, served in state.loras.adapters.items()]


def lora_routes(state: ServerState, allow_updating: bool) -> APIRouter:
    router = APIRouter()

    def registry():
        if not allow_updating:
            raise ApiError(404, "runtime LoRA updating is off: start the server with "
                                "--allow-runtime-lora-updating", code="not_found")
        if state.loras is None:
            raise ApiError(400, "LoRA is off: start the server with --enable-lora")
        return state.loras

    @router.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        loras = registry()
        try:
            loras.load(body.lora_name, body.lora_path)
        except ValueError as exc:  # a name taken, or what is wrong with the adapter's files
            param = "lora_name" if body.lora_name in loras.adapters or not body.lora_name \
                or body.lora_name == loras.base_name else "lora_path"
            raise ApiError(400, str(exc), param=param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras = registry()
        try:
            loras.unload(body.lora_name)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")

    return router
