"""A committed pydantic model and prompts for the structured-output tests: a nested object, an enum, a
list and an optional field. Every string and list is bounded, so that even a random-weight model's output
ends (the grammar enforces the bounds) within the tests' max_tokens."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, Field


class Priority(enum.StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Address(BaseModel):
    city: str = Field(max_length=16)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


class Contact(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    priority: Priority
    address: Address
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=12)


CONTACT_PROMPTS = [
    f"Write a contact card for {who} as JSON."
    for who in (
        "a baker in Lyon",
        "a pilot from Oslo",
        "a retired teacher",
        "a chess champion",
        "a marine biologist",
        "a jazz drummer",
        "a software engineer in Nairobi",
        "a farmer in Iowa",
        "a museum curator",
        "a mountain guide in Nepal",
        "a nurse in Manila",
        "a poet from Dublin",
        "a taxi driver in Lima",
        "a student in Seoul",
        "a carpenter in Quebec",
        "a violinist in Vienna",
        "a chef in Osaka",
        "a lighthouse keeper",
        "a botanist in Cape Town",
        "a firefighter in Denver",
    )
]
