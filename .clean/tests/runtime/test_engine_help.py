"""``help(Engine)`` shows every option: the signature spells out EngineConfig's fields with their defaults."""

from __future__ import annotations

import inspect
import pydoc
from dataclasses import MISSING, fields

from bcg.runtime import Engine
from bcg.runtime.config import EngineConfig


def test_engine_signature_lists_every_option_with_its_default() -> None:
    params = inspect.signature(Engine).parameters
    assert list(params)[:2] == ["model", "config"]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for f in fields(EngineConfig):
        p = params[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        expected = f.default if f.default is not MISSING else f.default_factory()
        assert p.default == expected, f.name


def test_help_text_shows_the_options() -> None:
    text = pydoc.render_doc(Engine, renderer=pydoc.plaintext)
    for snippet in ("backend: str = 'breakable'", "chunked_prefill_size: int = 2048",
                    "max_tokens: int | None = None", "help(EngineConfig)"):
        assert snippet in text, snippet
