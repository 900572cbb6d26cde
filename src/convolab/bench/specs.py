"""The command line's small languages: `--impl NAME[:key=value,...]` and
`--variant MODE[:layer.key=value,...]`, parsed into values the plan and the runner share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from convolab.errors import ConvolabError
from convolab.precision import network_mode

NETWORK_LAYERS = ("c1", "c3", "head")


def parse_value(text: str) -> int | float | str:
    """'3' -> 3, '1e-3' -> 0.001, anything else stays a string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _pairs(text: str, what: str) -> list[tuple[str, int | float | str]]:
    pairs = []
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConvolabError(f"{what}: expected key=value, got {item!r}")
        pairs.append((key.strip(), parse_value(value.strip())))
    return pairs


def _params_label(params: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


@dataclass(frozen=True)
class ImplSpec:
    """One contender row: a registered implementation and the parameters it runs with."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.name}[{_params_label(dict(self.params))}]" if self.params else self.name

    @classmethod
    def of(cls, name: str, params: Mapping[str, Any] | None = None) -> ImplSpec:
        return cls(name, tuple((params or {}).items()))


def parse_impl(text: str) -> ImplSpec:
    """`fused-conv-pool2:pipe=1,bps=2` -> ImplSpec('fused-conv-pool2', pipe=1, bps=2)."""
    name, colon, rest = text.partition(":")
    if not name.strip():
        raise ConvolabError(f"--impl {text!r}: no implementation name")
    if colon and not rest.strip():
        raise ConvolabError(f"--impl {text!r}: nothing after ':' (NAME:key=value,...)")
    params = _pairs(rest, f"--impl {text!r}") if colon else []
    return ImplSpec(name.strip(), tuple(params))


@dataclass(frozen=True)
class VariantSpec:
    """One whole-network row: FusedLeNet in `mode` with per-layer kernel parameters."""

    mode: str
    kernel_params: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = field(default=())

    def kernel_params_dict(self) -> dict[str, dict[str, Any]]:
        return {layer: dict(params) for layer, params in self.kernel_params}

    @property
    def label(self) -> str:
        parts = [f"{layer}.{k}={v}" for layer, ps in self.kernel_params for k, v in ps]
        return f"fused {self.mode}" + (f" [{','.join(parts)}]" if parts else "")

    @classmethod
    def of(cls, mode: str, kernel_params: Mapping[str, Mapping[str, Any]] | None = None
           ) -> VariantSpec:
        kp = kernel_params or {}
        return cls(mode, tuple((layer, tuple(kp[layer].items())) for layer in NETWORK_LAYERS
                               if kp.get(layer)))


def parse_variant(text: str) -> VariantSpec:
    """`exact:c1.cw=-1,c3.pipe=-1` -> VariantSpec('exact', c1 {cw: -1}, c3 {pipe: -1})."""
    mode_text, colon, rest = text.partition(":")
    try:
        mode = network_mode(mode_text.strip())
    except ValueError as err:
        raise ConvolabError(f"--variant {text!r}: {err}") from None
    if colon and not rest.strip():
        raise ConvolabError(f"--variant {text!r}: nothing after ':' (MODE:layer.key=value,...)")
    kp: dict[str, dict[str, Any]] = {}
    for key, value in (_pairs(rest, f"--variant {text!r}") if colon else []):
        layer, dot, param = key.partition(".")
        if not dot or layer not in NETWORK_LAYERS or not param:
            raise ConvolabError(f"--variant {text!r}: {key!r} must be LAYER.key with LAYER one "
                                f"of {', '.join(NETWORK_LAYERS)}")
        kp.setdefault(layer, {})[param] = value
    return VariantSpec.of(mode, kp)
