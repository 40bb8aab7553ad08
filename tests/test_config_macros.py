"""${PORT} and ${MODEL} in an engine's command (llmproxy/config/macros.py), expanded when the
config is read; a macro that cannot be expanded is an error naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.config import ConfigError, parse_config


def config(command: list[str], models: dict[str, Any] | None = None,
           **engine: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
                       "engines": {"big": {"command": command, **engine}}}],
            "models": {"qwen": {"host": "gpu1", "engine": "big", "upstream": "qwen2.5"}}
            if models is None else models}


def command(cfg: dict[str, Any]) -> tuple[str, ...]:
    return parse_config(cfg).hosts[0].engines["big"].command


def test_port_and_model_are_the_urls_port_and_the_models_upstream_name() -> None:
    """Whole words and parts of words; the engine's own url wins over its host's."""
    assert command(config(["llama-server", "--port", "${PORT}", "--alias=${MODEL}"])) == (
        "llama-server", "--port", "8081", "--alias=qwen2.5")
    assert command(config(["s", "${PORT}"], url="http://10.0.0.5:9000")) == ("s", "9000")
    assert command(config(["s", "${PORT}"], url="https://10.0.0.5")) == ("s", "443")


def test_a_command_without_macros_is_kept_as_written() -> None:
    assert command(config(["llama-server", "--port", "8081", "$PORT", "{MODEL}"])) == (
        "llama-server", "--port", "8081", "$PORT", "{MODEL}")


@pytest.mark.parametrize(("words", "models", "message"), [
    (["s", "${FOO}"], None,
     "hosts[0].engines.big.command: unknown macro ${FOO}: the macros are ${PORT}, ${MODEL}"),
    (["s", "${MODEL}"], {},
     "hosts[0].engines.big.command: ${MODEL}: 0 model names run on engine big of gpu1 "
     "(no model names it): write the name instead"),
    (["s", "${MODEL}"], {"a": {"host": "gpu1", "engine": "big"},
                         "b": {"host": "gpu1", "engine": "big"}},
     "hosts[0].engines.big.command: ${MODEL}: 2 model names run on engine big of gpu1 (a, b): "
     "write the name instead"),
])
def test_a_macro_that_cannot_be_expanded_is_an_error_naming_the_field(
        words: list[str], models: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(words, models))
    assert message in caught.value.errors


def test_two_models_of_one_upstream_name_are_one_name() -> None:
    """Aliases of one upstream model name give ${MODEL} that name."""
    models = {"a": {"host": "gpu1", "engine": "big", "upstream": "q"},
              "b": {"host": "gpu1", "engine": "big", "upstream": "q"}}
    assert command(config(["s", "${MODEL}"], models)) == ("s", "q")
