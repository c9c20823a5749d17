"""Every setting has one type: a YAML value of the wrong type is refused like a bad flag
(``nmprune prune`` exits 2 with one line ``nmprune: error: ...`` naming the setting, and
writes nothing), whichever setting it is; valid values are kept exactly as given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest

import nmprune.cli
import nmprune.job
from nmprune.cli import build_parser, config_from_args, main
from nmprune.config import PruneSettings, RunConfig, build_config

BOOLEAN_SETTINGS = ("strict", "restart", "allow_pickle", "offload")

# YAML text -> the setting the error must name
BAD_YAML = {
    **{f'{key}: "{word}"': key for key in BOOLEAN_SETTINGS for word in ("no", "false", "yes")},
    'nsamples: "64"': "nsamples",   # a string for an int
    "reconstruct_lr: '3e-3'": "reconstruct_lr",  # quoted: a string stays a string
    "seed: true": "seed",           # a bool for an int
    "eval_limit: false": "eval_limit",  # a bool for an int or nothing
    "damp: true": "damp",           # a bool for a float
    "damp: .nan": "damp",           # a float that is not finite
    "method: [a]": "method",        # a list for a string
    "pattern: 2:4": "pattern",      # unquoted: YAML's base-60 integer 124
    "model: 3": "model",            # an int for a string or nothing
    "eval_tasks: 3": "eval_tasks",  # neither a list nor a string for a list
    "eval: [wiki, 3]": "eval",      # a list holding something else than strings
    "options: [1]": "options",      # a list for a mapping
    "overrides: {1: skip}": "overrides",  # a mapping with a key that is not a string
}


def _write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    return path


def _config(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["prune", *argv]))


# YAML text and the flags merged with it -> the setting the error must name
BAD_YAML_WITH_FLAGS = {
    ("eval: 3", ("--eval", "wiki")): "eval",
    ("overrides: [1]", ("--override", "*.q_proj=skip")): "overrides",
}
CASES = {**{(text, ()): name for text, name in BAD_YAML.items()}, **BAD_YAML_WITH_FLAGS}


@pytest.mark.parametrize("text, flags", sorted(CASES))
def test_wrongly_typed_yaml_setting_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, text: str,
                                               flags: tuple[str, ...]) -> None:
    def accepted(config: RunConfig, **kwargs: object) -> None:
        pytest.fail(f"the settings were accepted: {text}")

    monkeypatch.setattr(nmprune.job, "run", accepted)  # a missed refusal fails fast
    yaml_file = _write_yaml(tmp_path, text)
    assert main(["prune", "--config", str(yaml_file), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nmprune: error: "), err
    assert f"setting {CASES[text, flags]!r} must be " in lines[0], lines[0]
    assert {p.name for p in tmp_path.rglob("*")} == {"run.yaml"}


def test_the_message_names_setting_value_and_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        _config("--config", str(_write_yaml(tmp_path, 'strict: "no"')))
    assert str(refused.value) == "setting 'strict' must be true or false, got 'no' (a string)"
    with pytest.raises(ValueError, match=r"^setting 'offload' must be true, false or left out, "
                                         r"got 'false' \(a string\)$"):
        _config("--config", str(_write_yaml(tmp_path, 'offload: "false"')))
    with pytest.raises(ValueError, match=r"^setting 'eval' must be a list of strings, "
                                         r"got \['wiki', 3\] \(its item 3 is an integer\)$"):
        _config("--config", str(_write_yaml(tmp_path, "eval: [wiki, 3]")))


@pytest.mark.parametrize("name", sorted({f.name for f in fields(RunConfig)} - {"prune"}
                                        | {f.name for f in fields(PruneSettings)}))
def test_every_setting_is_type_checked(name: str) -> None:
    """No setting takes just anything: an object of no settings type is refused for each."""
    with pytest.raises(ValueError, match=f"^setting {name!r} must be .*, got <object object at"):
        build_config({name: object()})


@pytest.mark.parametrize("text, read, expected", [
    ("strict: true", lambda c: c.prune.strict, True),
    ("restart: false", lambda c: c.restart, False),
    ("allow_pickle: true", lambda c: c.allow_pickle, True),
    ("offload: false", lambda c: c.offload, False),
    ("offload: null", lambda c: c.offload, None),
    ("damp: 0", lambda c: c.prune.damp, 0.0),
    ("damp: 0.05", lambda c: c.prune.damp, 0.05),
    ("eval_limit: 5", lambda c: c.eval_limit, 5),
    ("eval_num_fewshot: 0", lambda c: c.eval_num_fewshot, 0),
    ("eval_tasks: nmprune_wiki_next", lambda c: c.eval_tasks, ["nmprune_wiki_next"]),
    ("eval_include_path: [tasks]", lambda c: c.eval_include_path, ["tasks"]),
    ("refine: none", lambda c: c.prune.refine, "none"),
    ("checkpoint_dir: ck", lambda c: c.checkpoint_dir, "ck"),
    ("device: cpu", lambda c: c.device, "cpu"),
    ("dtype: float32", lambda c: c.dtype, "float32"),
    ("options: {beta: 1.01}", lambda c: c.prune.options, {"beta": 1.01}),
    # exponent numbers without a dot, as the help prints the defaults: floats (YAML 1.2)
    ("reconstruct_lr: 3e-3", lambda c: c.prune.reconstruct_lr, 0.003),
    ("damp: 1e-2", lambda c: c.prune.damp, 0.01),
    ("options: {lambda0: 1e-3}", lambda c: c.prune.options, {"lambda0": 0.001}),
    ("overrides: {'*.q_proj': skip}", lambda c: c.prune.overrides, {"*.q_proj": "skip"}),
])
def test_valid_yaml_values_are_kept_as_given(tmp_path: Path, text: str,
                                             read: Callable[[RunConfig], object], expected: object) -> None:
    value = read(_config("--config", str(_write_yaml(tmp_path, text)), "--out", "o"))
    assert value == expected and type(value) is type(expected)


def test_flags_keep_their_types() -> None:
    c = _config("--out", "o", "--strict", "--restart", "--allow-pickle", "--offload", "--damp", "0",
                "--limit", "5", "--num-fewshot", "0", "--nsamples", "8", "--eval-tasks", "a,b",
                "--include-path", "tasks", "--checkpoint-dir", "ck", "--device", "cpu",
                "--dtype", "float32")
    assert (c.prune.strict, c.restart, c.allow_pickle, c.offload) == (True, True, True, True)
    assert c.prune.damp == 0.0 and type(c.prune.damp) is float and c.prune.nsamples == 8
    assert (c.eval_limit, c.eval_num_fewshot, c.eval_tasks, c.eval_include_path) == (5, 0, ["a,b"], ["tasks"])
    assert (c.checkpoint_dir, c.device, c.dtype) == ("ck", "cpu", "float32")
    plain = _config()
    assert (plain.prune.strict, plain.restart, plain.allow_pickle, plain.offload) == \
        (False, False, False, None)


def test_option_values_read_exponent_numbers_as_floats() -> None:
    """``--option lambda0=1e-3`` (the example of docs/architecture.md) is the float 0.001."""
    c = _config("--out", "o", "--option", "lambda0=1e-3", "--option", "name='2e5'")
    assert c.prune.options == {"lambda0": 0.001, "name": "2e5"} and type(c.prune.options["lambda0"]) is float
