"""A command-line flag defined once: how argparse adds and reads it, which config field it sets, and how a
launcher writes a value back as arguments for a process it starts; plus the argparse value types."""

from __future__ import annotations

import argparse
import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.device import check_device, check_gpu_memory_utilization


class Switch(enum.Enum):
    """How the flag is written: with a value, or alone (setting True, or False for a ``--no-...`` one)."""

    VALUE = "value"
    ON = "on"
    OFF = "off"
    BOTH = "both"  # ``--x`` sets True, ``--no-x`` False (vLLM's spelling of its switches)


@dataclass(frozen=True)
class Flag:
    """One option. ``field`` names the config field it sets (through ``to_field``); "" when the caller
    resolves the value itself (a default computed at start, a setting that is no config field)."""

    option: str  # "--kv-blocks"
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    switch: Switch = Switch.VALUE
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False
    dest: str = ""  # the parsed attribute; "": the option's words ("--kv-blocks" -> kv_blocks)
    field: str = ""
    to_field: Callable[[Any], Any] | None = None

    @property
    def name(self) -> str:
        return self.dest or self.option.removeprefix("--").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        kwargs: dict[str, Any] = {"help": self.help, "default": self.default}
        if self.dest:
            kwargs["dest"] = self.dest
        if self.switch is Switch.ON:
            kwargs["action"] = "store_true"
        elif self.switch is Switch.OFF:
            kwargs["action"] = "store_false"
        elif self.switch is Switch.BOTH:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
            if self.required:
                kwargs["required"] = True
        parser.add_argument(self.option, **kwargs)

    def argv(self, value: Any) -> list[str]:
        """The arguments that give a started process ``value`` (none for the default: it has the same)."""
        if value == self.default:
            return []
        if self.switch is Switch.BOTH:
            return [self.option if value else "--no-" + self.option.removeprefix("--")]
        if self.switch is not Switch.VALUE:
            return [self.option]
        return [self.option, str(value)]

    def field_value(self, args: argparse.Namespace) -> Any:
        value = getattr(args, self.name)
        return value if self.to_field is None else self.to_field(value)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[Flag]) -> None:
    for flag in flags:
        flag.add_to(parser)


def forward(args: argparse.Namespace, flags: Iterable[Flag]) -> list[str]:
    """What a launcher hands a process it starts: each of ``flags`` whose parsed value is not its default."""
    return [word for flag in flags for word in flag.argv(getattr(args, flag.name))]


def config_fields(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[str, Any]:
    """The config fields ``flags`` set from the parsed ``args`` (keyword arguments for the config)."""
    return {flag.field: flag.field_value(args) for flag in flags if flag.field}


# ---- argparse value types: a bad value is refused naming the flag, before anything starts --------------


def nonneg(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (what the request's proto field holds)."""

    def parse(text: str) -> int:
        n = int(text)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    return parse


def seconds(positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        x = float(text)
        if not math.isfinite(x) or (x <= 0 if positive else x < 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {text}")
        return x

    return parse


def device(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fraction(text: str) -> float:
    try:
        return check_gpu_memory_utilization(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], e.g. 0.9; got {text!r}") from None
