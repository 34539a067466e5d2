"""``DeepSpeedStrategy(gradient_clipping=...)``: the config's ``gradient_clipping`` without restating the whole config
(no DeepSpeed engine, no deepspeed installation needed)."""

from __future__ import annotations

import pytest

import phalanx.strategies.deepspeed.strategy as deepspeed_module
from phalanx.strategies import DeepSpeedStrategy, RunSettings
from phalanx.strategies.deepspeed.strategy import CONFIG_ENV_VAR


@pytest.fixture(autouse=True)
def _deepspeed_installed(monkeypatch):
    monkeypatch.setattr(deepspeed_module, "deepspeed_available", lambda: True)
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


def _built(strategy: DeepSpeedStrategy, clip: float | None = None) -> dict:
    return strategy._build_config(RunSettings(stage="validate", gradient_clip_val=clip))


@pytest.mark.parametrize(
    ("kwargs", "trainer_clip", "expected"),
    [
        ({}, None, 0.0),  # phalanx clips only when asked
        ({"gradient_clipping": 0.5}, None, 0.5),
        ({"gradient_clipping": 2}, None, 2.0),
        ({"gradient_clipping": 0.0}, None, 0.0),
        ({"gradient_clipping": 0.5, "stage": 3}, None, 0.5),
        ({"gradient_clipping": 0.5, "config": {"zero_optimization": {"stage": 1}}}, None, 0.5),
        ({"gradient_clipping": 0.5, "config": {"gradient_clipping": 0.5}}, None, 0.5),
        ({"config": {"gradient_clipping": 0.25}}, None, 0.25),
        ({"gradient_clipping": 0.5}, 0.5, 0.5),  # the Trainer's gradient_clip_val, the same
    ],
)
def test_gradient_clipping_lands_in_the_config(kwargs, trainer_clip, expected):
    strategy = DeepSpeedStrategy(**kwargs)
    assert _built(strategy, trainer_clip)["gradient_clipping"] == expected
    if "gradient_clipping" in kwargs:
        assert strategy.config["gradient_clipping"] == expected  # before setup too


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gradient_clipping": -1.0}, r"gradient_clipping=-1.0\) must be a number >= 0"),
        ({"gradient_clipping": "1"}, r"gradient_clipping='1'\) must be a number >= 0"),
        ({"gradient_clipping": True}, r"gradient_clipping=True\) must be a number >= 0"),
        (
            {"gradient_clipping": 0.5, "config": {"gradient_clipping": 1.0}},
            r"gradient_clipping=0.5\) conflicts with the config's gradient_clipping=1.0; set it in one place",
        ),
    ],
)
def test_bad_or_conflicting_gradient_clipping_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedStrategy(**kwargs)


def test_a_different_trainer_gradient_clip_val_is_refused():
    with pytest.raises(ValueError, match="gradient_clipping=0.5 but the Trainer has gradient_clip_val=1.0"):
        _built(DeepSpeedStrategy(gradient_clipping=0.5), 1.0)


def test_a_given_config_is_not_changed_in_the_callers_hands():
    config = {"zero_optimization": {"stage": 2}}
    DeepSpeedStrategy(gradient_clipping=0.5, config=config)
    assert "gradient_clipping" not in config
