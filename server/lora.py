"""LoRA adapters served by name (docs/lora.md): `--lora-modules NAME=PATH` at start-up, and with
`--allow-runtime-lora-updating` vLLM's `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`.

A request picks an adapter by `model`; validation (server/validation.py `check_model`) looks the name
up in `ModelLimits.lora_adapters`, the one dict this module edits. Each adapter gets a new id when
it is loaded, so an adapter unloaded and loaded again from another path never meets its old KV
blocks or its old weights in the engine. The server checks `adapter_config.json`
(models/lora_config.py: no torch here); the engine reads the weights when a request first uses
them, and a weight that does not fit the base model fails that request with a 400.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from kvserve.engine.lora_request import LoRARequest
from kvserve.models.lora_config import read_adapter_config
from kvserve.server.errors import APIError, bad_request
from kvserve.server.openapi import errors
from kvserve.server.protocol import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The served adapters by name (`adapters` is `ModelLimits.lora_adapters`)."""

    def __init__(
        self, adapters: dict[str, LoRARequest], base_names: list[str], max_lora_rank: int
    ) -> None:
        self.adapters, self.base_names, self.max_lora_rank = adapters, base_names, max_lora_rank
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name`; APIError 400 naming what is wrong."""
        if not name:
            raise bad_request("lora_name must not be empty", param="lora_name")
        if name in self.adapters or name in self.base_names:
            raise bad_request(f"the model `{name}` is already served", param="lora_name")
        if not Path(path).is_dir():
            raise bad_request(f"lora_path {path!r} is not a directory", param="lora_path")
        if not (Path(path) / "adapter_model.safetensors").is_file():
            raise bad_request(
                f"lora_path {path!r} has no adapter_model.safetensors", param="lora_path"
            )
        try:
            read_adapter_config(path, self.max_lora_rank)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        request = LoRARequest(name, next(self._ids), str(Path(path).resolve()))
        self.adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(
                404,
                f"The LoRA adapter `{name}` is not loaded.",
                param="lora_name",
                code="model_not_found",
            )

    def load_modules(self, specs: list[str]) -> None:
        """`--lora-modules NAME=PATH ...`; ValueError (start-up fails) for a bad one."""
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
            try:
                self.load(name, path)
            except APIError as e:
                raise ValueError(f"--lora-modules {spec!r}: {e.message}") from None

    def model_cards(self, created: int, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(
                id=name,
                created=created,
                root=req.lora_path,
                parent=self.base_names[0],
                max_model_len=max_model_len,
            )
            for name, req in self.adapters.items()
        ]


def add_lora_routes(app: FastAPI, modules: Callable[[Request], LoRAModules]) -> None:
    """vLLM's runtime adapter routes (`--allow-runtime-lora-updating`); `modules(request)` is the app's."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors(400))
    async def load_lora_adapter(
        body: LoadLoRAAdapterRequest, request: Request
    ) -> PlainTextResponse:
        modules(request).load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=errors(404))
    async def unload_lora_adapter(
        body: UnloadLoRAAdapterRequest, request: Request
    ) -> PlainTextResponse:
        modules(request).unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
