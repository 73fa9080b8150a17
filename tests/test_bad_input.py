"""Bad input on every public surface is refused with a message naming the option, the value and what is
allowed (docs/errors.md lists them): the optimizers, the vote configuration, the quantizers, the unit
parsers, the workloads, the cost model and the CLIs (``launch``, ``train``, ``compare``, ``cost``,
``calibrate``, ``report``).

The CLIs run in-process through :func:`lioncub.cli.main`; every case must fail at validation, before any
process is launched (``launch`` is replaced by a stub that fails the test if it is reached) and, for
``train``/``compare``, before anything is written to ``--out``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lioncub.ops import quantize
from lioncub.optim import PRESETS, Lion, LionCub, make_vote, resolve_variant
from lioncub.optim.config import VoteConfig
from lioncub.optim.lioncub import Checks
from lioncub.optim.sync import MomentumSync, select_parameters
from lioncub.planning import costmodel as cm
from lioncub.planning.auto import AUTO_ENV, auto_variant, resolve_network
from lioncub.train.workloads import check_workload, make_workload
from lioncub.units import parse_count, parse_duration, parse_rate, parse_size
from sim_comm import fake_comm


def case(*values: Any, id: str) -> Any:
    return pytest.param(*values, id=id)


def assert_names(message: str, fragments: list[str]) -> None:
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{missing} not in the message: {message!r}"


def assert_refused(
    call: Callable[[], Any],
    fragments: list[str],
    exc: type[BaseException] | tuple[type[BaseException], ...] = ValueError,
) -> None:
    """``call()`` raises ``exc`` with a message naming every one of ``fragments``."""
    with pytest.raises(exc) as err:
        call()
    assert_names(str(err.value), fragments)


# ------------------------------------------------------------------------------------------------ Lion


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.zeros(3))]


LION_CASES = [
    case({"lr": -1.0}, ["lr", "-1", ">= 0"], id="lr-negative"),
    case({"lr": math.nan}, ["lr", "nan", ">= 0"], id="lr-nan"),
    case({"lr": "fast"}, ["lr", "'fast'", ">= 0"], id="lr-text"),
    case({"betas": (1.5, 0.0)}, ["betas[0]", "1.5", "0 <= beta < 1"], id="beta1-above-1"),
    case({"betas": (0.9, -0.1)}, ["betas[1]", "-0.1", "0 <= beta < 1"], id="beta2-negative"),
    case({"betas": 0.9}, ["betas", "0.9", "pair"], id="betas-not-a-pair"),
    case({"weight_decay": -0.1}, ["weight_decay", "-0.1", ">= 0"], id="wd-negative"),
    case({"weight_decay": math.inf}, ["weight_decay", "inf", "finite"], id="wd-inf"),
    case({"foreach": 1}, ["foreach", "None, True or False"], id="foreach-int"),
    case({"maximize": "yes"}, ["maximize", "True or False"], id="maximize-text"),
    case({"momentum_dtype": torch.int32}, ["momentum_dtype", "floating"], id="momentum-dtype-int"),
    case({"lr": True}, ["lr", "True", ">= 0"], id="lr-bool"),
]


@pytest.mark.parametrize(("kwargs", "fragments"), LION_CASES)
def test_lion_refuses(kwargs: dict, fragments: list[str]) -> None:
    assert_refused(lambda: Lion(_params(), **kwargs), fragments)


# --------------------------------------------------------------------------------------------- LionCub


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A one-rank gloo group (LionCub needs a process group; N = 1 exchanges nothing)."""
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


class Later:
    """A value built inside the test's ``pytest.raises`` (the constructors refuse bad input themselves)."""

    def __init__(self, make: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.make, self.args, self.kwargs = make, args, kwargs

    def __call__(self) -> Any:
        return self.make(*self.args, **self.kwargs)


def knobs(preset: str = "8bit", **overrides: Any) -> Later:
    """``variant=resolve_variant(preset, **overrides)``, built inside the test."""
    return Later(resolve_variant, preset, **overrides)


def sync(**fields: Any) -> Later:
    """``momentum_sync=MomentumSync("all", **fields)``, built inside the test."""
    return Later(MomentumSync, "all", **fields)


def checks(**fields: Any) -> Later:
    """``checks=Checks(**fields)``, built inside the test."""
    return Later(Checks, **fields)


LIONCUB_CASES = [
    case({"lr": -1.0}, ValueError, ["lr", "-1", ">= 0"], id="lr-negative"),
    case({"betas": (1.5, 0)}, ValueError, ["betas[0]", "1.5", "0 <= beta < 1"], id="betas"),
    case({"variant": "3bit"}, ValueError, ["variant", "3bit", "'8bit'", "auto"], id="variant-unknown"),
    case({"variant": ["8bit"]}, ValueError, ["variant", "8bit", "'1bit'"], id="variant-list"),
    case({"variant": knobs("4bit", bits=3)}, ValueError, ["bits=3", "2, 4, 8 or 'auto'"], id="bits-3"),
    case({"variant": knobs("1bit", bits=4)}, ValueError, ["bits=4", "'1bit'", "lanes"], id="bits-on-1bit"),
    case(
        {"variant": knobs("1bit", quantizer="l1")},
        ValueError,
        ["quantizer='l1'", "quantized"],
        id="quantizer-1bit",
    ),
    case({"variant": knobs(quantizer="l9")}, ValueError, ["quantizer='l9'", "'l1'"], id="quantizer-unknown"),
    case(
        {"variant": knobs(transport="pigeon")},
        ValueError,
        ["transport='pigeon'", "'lanes'"],
        id="transport-unknown",
    ),
    case(
        {"variant": knobs(aggregation="median")},
        ValueError,
        ["aggregation='median'", "'majority'"],
        id="aggregation",
    ),
    case({"variant": knobs(clip_multiple=-1.0)}, ValueError, ["clip_multiple=-1", "> 0"], id="clip-negative"),
    case(
        {"variant": knobs("1bit", clip_multiple=3.0)},
        ValueError,
        ["clip_multiple=3.0", "quantized"],
        id="clip-1bit",
    ),
    case({"variant": knobs(chunk_size=0)}, ValueError, ["chunk_size=0", ">= 1"], id="chunk-0"),
    case(
        {"variant": VoteConfig("quantized", exchange="smoke")},
        ValueError,
        ["exchange='smoke'", "'p2p'"],
        id="exchange",
    ),
    case({"variant": knobs(seed="a")}, ValueError, ["seed='a'", "int"], id="seed-text"),
    case({"variant": "auto"}, ValueError, ["variant='auto'", "auto_variant"], id="auto-is-a-function"),
    case({"bucket_mb": 0}, ValueError, ["bucket_mb=0", "> 0"], id="bucket-0"),
    case({"bucket_mb": -5.0}, ValueError, ["bucket_mb=-5", "> 0"], id="bucket-negative"),
    case({"bucket_mb": math.inf}, ValueError, ["bucket_mb=inf", "finite"], id="bucket-inf"),
    case({"momentum_sync": sync(every=0)}, ValueError, ["every=0", ">= 1"], id="sync-every-0"),
    case({"momentum_sync": sync(every=True)}, ValueError, ["every=True", ">= 1"], id="sync-every-bool"),
    case({"momentum_sync": sync(until=-1)}, ValueError, ["until=-1", ">= 0"], id="sync-until"),
    case({"momentum_sync": sync(exp_k=0)}, ValueError, ["exp_k=0", ">= 1"], id="sync-exp-k"),
    case({"momentum_sync": sync(dtype=torch.int8)}, ValueError, ["dtype", "torch.float32"], id="sync-dtype"),
    case({"momentum_sync": "bogus"}, ValueError, ["momentum_sync='bogus'", "'io'"], id="sync-bogus"),
    case({"momentum_sync": []}, ValueError, ["momentum_sync=[]", "non-empty"], id="sync-empty"),
    case({"momentum_sync": 123}, ValueError, ["momentum_sync=123", "'all'"], id="sync-int"),
    case(
        {"momentum_sync": ["nomatch.*"]}, ValueError, ["momentum_sync", "nomatch", "param"], id="sync-nomatch"
    ),
    case({"momentum_sync": "io"}, ValueError, ["momentum_sync='io'", "model="], id="sync-io-no-model"),
    case(
        {"checks": checks(replica_check_every=-1)},
        ValueError,
        ["replica_check_every=-1", ">= 0"],
        id="replica-check",
    ),
    case(
        {"checks": checks(nonfinite="ignore")},
        ValueError,
        ["nonfinite='ignore'", "'skip'"],
        id="nonfinite",
    ),
    case({"checks": checks(broadcast_init=1)}, ValueError, ["broadcast_init=1", "True or False"], id="bcast"),
    case({"checks": "strict"}, TypeError, ["checks='strict'", "Checks("], id="checks-not-checks"),
    case({"diagnostics_every": -1}, ValueError, ["diagnostics_every=-1", ">= 0"], id="diagnostics"),
    case(
        {"variant": "32bit", "diagnostics_every": 5},
        ValueError,
        ["diagnostics_every", "voting"],
        id="diag-32",
    ),
    case({"maximize": 1}, ValueError, ["maximize", "True or False"], id="maximize"),
    case({"model": "not a module"}, TypeError, ["model", "Module"], id="model-not-module"),
    case({"local_steps": 0}, ValueError, ["LocalSteps: h=0", ">= 1"], id="local-h-0"),
    case({"local_steps": "16"}, TypeError, ["local_steps='16'", "LocalSteps(h=...)"], id="local-text"),
    case({"local_steps": {"H": 4}}, ValueError, ["unknown keys ['H']", "'outer'"], id="local-key"),
    case(
        {"local_steps": {"h": 4, "outer": "sgd"}}, ValueError, ["outer='sgd'", "'diloco'"], id="local-outer"
    ),
    case({"local_steps": {"h": 4, "outer_lr": 0}}, ValueError, ["outer_lr=0", "> 0"], id="local-outer-lr"),
    case(
        {"local_steps": {"h": 4, "outer_betas": (1.0, 0.9)}},
        ValueError,
        ["outer_betas=(1.0, 0.9)", "[0, 1)"],
        id="local-betas",
    ),
    case(
        {"local_steps": {"h": 4, "inner_momentum": "zero"}},
        ValueError,
        ["inner_momentum='zero'", "'reset'"],
        id="local-inner",
    ),
    case(
        {"local_steps": {"h": 4, "outer": "dsm"}},
        ValueError,
        ["outer='dsm'", "variant='32bit' or variant='16bit'", "not variant='8bit'"],
        id="local-dsm-1bit",
    ),
    case(
        {"local_steps": 4, "momentum_sync": "all"},
        ValueError,
        ["momentum_sync='all' with local_steps=4", "inner_momentum='average'"],
        id="local-sync",
    ),
    case(
        {"local_steps": 4, "diagnostics_every": 2},
        ValueError,
        ["diagnostics_every=2 with local_steps=4", "drop diagnostics_every"],
        id="local-diag",
    ),
]


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), LIONCUB_CASES)
def test_lioncub_refuses(group: Any, kwargs: dict, exc: type[Exception], fragments: list[str]) -> None:
    assert_refused(
        lambda: LionCub(_params(), **{k: v() if isinstance(v, Later) else v for k, v in kwargs.items()}),
        fragments,
        exc,
    )


AUTO_CASES = [
    case({}, ValueError, ["network", "LIONCUB_CALIBRATION"], id="auto-no-network"),
    case({"network": "10furlongs"}, ValueError, ["network", "furlongs", "gbit"], id="auto-bad-rate"),
    case(
        {"network": "/nonexistent/calib.json"},
        ValueError,
        ["network", "/nonexistent/calib.json", "lioncub calibrate"],
        id="auto-missing-json",
    ),
    case({"network": "1gbit", "latency_s": -1.0}, ValueError, ["latency_s=-1", ">= 0"], id="auto-latency"),
    case(
        {"network": "1gbit", "candidates": ["9bit"]},
        ValueError,
        ["candidates", "9bit", "'8bit'"],
        id="auto-candidates",
    ),
    case({"network": 123}, TypeError, ["network=123", "1gbit"], id="auto-int"),
]


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), AUTO_CASES)
def test_auto_variant_refuses(
    group: Any, monkeypatch: pytest.MonkeyPatch, kwargs: dict, exc: type[Exception], fragments: list[str]
) -> None:
    monkeypatch.delenv(AUTO_ENV, raising=False)
    assert_refused(lambda: auto_variant(_params(), **kwargs), fragments, exc)


@pytest.mark.parametrize(
    ("config", "n", "fragments"),
    [
        (PRESETS["4bit"], 16, ["bits=4", "'lanes'", "16 workers", "at most 15", "[8]", "'auto'"]),
        (PRESETS["8bit"], 128, ["bits=8", "'quantized'", "128 workers", "at most 127", "'1bit'"]),
        (resolve_variant("8bit", bits=2), 2, ["bits=2", "2 workers", "[4, 8]"]),
        (resolve_variant("4bit", bits=2), 4, ["bits=2", "4 workers", "at most 3", "[4, 8]"]),
        (PRESETS["8bit-sign"], 200, ["'int8'", "200 workers", "at most 127", "'dlion-mavo'"]),
        (PRESETS["dlion-avg"], 128, ["aggregation='average'", "128 workers", "at most 127"]),
    ],
    ids=["4bit-16", "8bit-128", "quantized-2bit-2", "lanes-2bit-4", "8bit-sign-200", "dlion-avg-128"],
)
def test_bits_not_supported_for_n_workers(config: VoteConfig, n: int, fragments: list[str]) -> None:
    assert_refused(lambda: make_vote(fake_comm(n), config), fragments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda: VoteConfig("dense", "mean", None, None, torch.int8).validate(), ["wire_dtype"]),
        (
            lambda: VoteConfig("1bit", "majority", None, 1, torch.bfloat16).validate(),
            ["wire_dtype", "'dense'"],
        ),
        (lambda: VoteConfig("quantized", server_root=-1).validate(), ["server_root=-1", ">= 0"]),
        (
            lambda: VoteConfig("int8", "majority", None, 8, quantizer_options={"p": 3}).validate(),
            ["quantizer_options"],
        ),
        (lambda: resolve_variant("8bit", nonsense=1), ["nonsense", "clip_multiple"]),
    ],
    ids=["dense-int8-wire", "wire-dtype-on-1bit", "server-root", "options-on-int8", "unknown-knob"],
)
def test_vote_config_refuses(make: Callable[[], Any], fragments: list[str]) -> None:
    assert_refused(lambda: make_vote(fake_comm(2), make()), fragments, (ValueError, TypeError))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "fragments"),
    [
        (lambda: MomentumSync(every=True), ["every=True", ">= 1"]),
        (lambda: select_parameters(["ok", 3], [], [], None), ["momentum_sync", "strings"]),
        (lambda: select_parameters((), [], [], None), ["momentum_sync=()", "non-empty"]),
    ],
    ids=["every-bool", "non-string-pattern", "empty-tuple"],
)
def test_momentum_sync_refuses(call: Callable[[], Any], fragments: list[str]) -> None:
    assert_refused(call, fragments)


def test_auto_calibration_from_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIONCUB_CALIBRATION", "/nonexistent/cal.json")
    assert_refused(
        lambda: resolve_network(None), ["$LIONCUB_CALIBRATION", "/nonexistent/cal.json", "lioncub calibrate"]
    )


# ------------------------------------------------------------------------------------------ quantizers

X = torch.linspace(-1, 1, 16)

QUANTIZER_CASES = [
    case(
        lambda: quantize.level_budget(64, 3), ["3-bit", "n_workers=64", "at most 3 workers"], id="budget-64x3"
    ),
    case(lambda: quantize.level_budget(200, 8), ["n_workers=200", "at most 127"], id="budget-200x8"),
    case(lambda: quantize.level_budget(0, 8), ["n_workers=0", ">= 1"], id="budget-0-workers"),
    case(lambda: quantize.level_budget(4, 0), ["bits=0", ">= 1"], id="budget-0-bits"),
    case(lambda: quantize.level_budget(4, 8, "zigzag"), ["encoding='zigzag'", "'signed'"], id="encoding"),
    case(lambda: quantize.quantize_l1(X, 0), ["levels=0", ">= 1"], id="levels-0"),
    case(lambda: quantize.quantize_l1(X, 2**31), ["levels=2147483648", "2**30"], id="levels-huge"),
    case(lambda: quantize.quantize_l1(X, 3, clip_multiple=0), ["clip_multiple=0", "> 0"], id="clip-0"),
    case(lambda: quantize.quantize_l1(X, 3, chunk_size=0), ["chunk_size=0", ">= 1"], id="chunk-0"),
    case(lambda: quantize.quantize_lp(X, 3, p=-1), ["p=-1", "positive"], id="p-negative"),
    case(lambda: quantize.quantize_qsgd(X, 3, norm="1"), ["norm='1'", "'inf' or '2'"], id="qsgd-norm"),
    case(lambda: quantize.quantize("l9", X, 3), ["quantizer='l9'", "'l1'"], id="name"),
    case(lambda: quantize.quantize_l1(torch.arange(4), 3), ["floating-point", "int64"], id="int-tensor"),
    case(lambda: quantize.quantize_l0(X, 3, eps=-1.0), ["eps=-1", "> 0"], id="l0-eps-negative"),
    case(lambda: quantize.quantize_l1(X, 3, chunk_size=True), ["chunk_size=True", ">= 1"], id="chunk-bool"),
    case(lambda: quantize.level_budget(True, 8), ["n_workers=True", ">= 1"], id="budget-bool-workers"),
    case(
        lambda: quantize.quantize("l1", X, 3, bogus=1),
        ["bogus", "clip_multiple", "chunk_size"],
        id="unknown-option",
    ),
]


@pytest.mark.parametrize(("call", "fragments"), QUANTIZER_CASES)
def test_quantizers_refuse(call: Callable[[], Any], fragments: list[str]) -> None:
    assert_refused(call, fragments, (ValueError, TypeError))


# --------------------------------------------------------------------------------------- unit parsers


@pytest.mark.parametrize(
    ("call", "fragments"),
    [
        (lambda: parse_rate("10furlongs"), ["--link", "furlongs", "gbit"]),
        (lambda: parse_rate("0mbit"), ["--link", "positive"]),
        (lambda: parse_rate("9" * 400 + "gbit"), ["--link", "finite"]),
        (lambda: parse_size("9" * 400 + "kb"), ["--burst", "finite"]),
        (lambda: parse_size("0kb", "--sizes"), ["--sizes", "positive"]),
        (lambda: parse_count("1e400"), ["--params", "finite", ">= 1"]),
        (lambda: parse_count("774Q"), ["--params", "774M"]),
        (lambda: parse_duration("1e400s"), ["--latency", "finite", "50us"]),
        (lambda: parse_duration("5"), ["--latency", "50us"]),
    ],
    ids=[
        "rate-unit",
        "rate-zero",
        "rate-huge",
        "size-huge",
        "size-zero",
        "count-huge",
        "count-unit",
        "duration-huge",
        "duration-no-unit",
    ],
)
def test_unit_parsers_refuse(call: Callable[[], Any], fragments: list[str]) -> None:
    assert_refused(call, fragments)


# ------------------------------------------------------------------------------------------ workloads

WORKLOAD_CASES = [
    ("gpt", {"n_embd": -1}, ["n_embd=-1", ">= 1"]),
    ("gpt", {"n_embd": "abc"}, ["n_embd='abc'", ">= 1"]),
    ("gpt", {"n_head": 3}, ["n_embd=64", "n_head=3", "multiple"]),
    ("gpt", {"batch_size": 0}, ["batch_size=0", ">= 1"]),
    ("gpt", {"lr": -1}, ["lr=-1", ">= 0"]),
    ("gpt", {"betas": [1.5, 0]}, ["betas=[1.5, 0]", "0 <= beta < 1"]),
    ("gpt", {"dropout": 1.5}, ["dropout=1.5", "[0, 1)"]),
    ("gpt", {"val_fraction": 2}, ["val_fraction=2", "(0, 1)"]),
    ("gpt", {"corpus": "nonexist"}, ["corpus='nonexist'", "shakespeare"]),
    ("gpt", {"tokenizer": "bpe"}, ["tokenizer='bpe'", "'gpt2'"]),
    ("gpt", {"bias": "True"}, ["bias='True'", "true or false"]),
    ("gpt", {"seed": -1}, ["seed=-1", ">= 0"]),
    ("cnn", {"dataset": "cifar"}, ["dataset='cifar'", "fashion-mnist"]),
    ("cnn", {"widths": []}, ["widths=[]", "non-empty"]),
    ("cnn", {"blocks_per_stage": 0}, ["blocks_per_stage=0", ">= 1"]),
]


@pytest.mark.parametrize(("name", "overrides", "fragments"), WORKLOAD_CASES, ids=lambda v: str(v)[:24])
def test_workload_fields_refused_without_loading_data(
    name: str, overrides: dict, fragments: list[str]
) -> None:
    assert_refused(lambda: check_workload(name, "tiny", overrides), fragments)
    with pytest.raises(ValueError):  # the ranks refuse them too, before reading any data
        make_workload(name, "tiny", **overrides)


def test_workload_names_and_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_refused(lambda: check_workload("gpt", "tiny", {"n_layers": 3}), ["n_layers", "n_layer"], TypeError)
    with pytest.raises(ValueError) as err2:
        check_workload("gpt", "huge")
    assert_names(str(err2.value), ["huge", "tiny"])
    monkeypatch.setenv("LIONCUB_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as err3:
        check_workload("gpt", "small")
    assert_names(str(err3.value), ["shakespeare.txt", "LIONCUB_DATA=", "lioncub data fetch"])
    with pytest.raises(ValueError) as err4:
        make_workload("gpt", "tiny", block_size=100_000)
    assert_names(str(err4.value), ["block_size=100000", "below"])


def test_unreadable_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    (tmp_path / "shakespeare.txt").write_text("to be")
    (tmp_path / "shakespeare.txt").chmod(0)
    monkeypatch.setenv("LIONCUB_DATA", str(tmp_path))
    assert_refused(
        lambda: check_workload("gpt", "small"), ["shakespeare.txt", "not readable"], PermissionError
    )


# ----------------------------------------------------------------------------------------- cost model


@pytest.mark.parametrize(
    ("call", "fragments"),
    [
        (
            lambda: cm.predict("8bit", 1000, 4, cm.Network(5e-5, 1e8), sync_params=10),
            ["sync_params", "sync_every"],
        ),
        (
            lambda: cm.predict("8bit", 1000, 4, cm.Network(5e-5, 1e8), sync_every=10, sync_params=5000),
            ["sync_params=5000", "[0, d=1000]"],
        ),
        (
            lambda: cm.predict("8bit", 1000, 4, cm.Network(5e-5, 1e8), bucket_numel=0),
            ["bucket_numel=0", ">= 1"],
        ),
        (lambda: cm.predict("8bit", 1000, 0, cm.Network(5e-5, 1e8)), ["n_workers=0", ">= 1"]),
        (lambda: cm.predict("9bit", 1000, 4, cm.Network(5e-5, 1e8)), ["variant='9bit'", "'8bit'"]),
        (
            lambda: cm.winner(1000, 200, cm.Network(5e-5, 1e8), variants=["8bit"]),
            ["N=200", "at most 127", "'1bit'"],
        ),
        (lambda: cm.Network(-1.0, 1e8), ["latency_s=-1", ">= 0"]),
    ],
    ids=[
        "sync-params-alone",
        "sync-params-above-d",
        "bucket-0",
        "workers-0",
        "variant",
        "none-allowed",
        "latency",
    ],
)
def test_costmodel_refuses(call: Callable[[], Any], fragments: list[str]) -> None:
    assert_refused(call, fragments)


# ----------------------------------------------------------------------------------------------- CLIs


def check_cli(run_cli: Callable, argv: list[str], fragments: list[str]) -> None:
    rc, err = run_cli(argv)
    assert rc != -1, "not refused: the command reached the launcher"
    assert rc == 2, f"exit code {rc}, stderr: {err!r}"
    assert_names(err, fragments)


LAUNCH_CASES = [
    case(["--nproc", "0"], ["--nproc", ">= 1"], id="nproc-0"),
    case(["--nproc", "x"], ["--nproc", "invalid int"], id="nproc-text"),
    case(["--link", "10furlongs"], ["--link", "furlongs", "gbit"], id="link-unit"),
    case(["--link", "0mbit"], ["--link", "positive"], id="link-zero"),
    case(["--link", "1gbit", "--mtu", "10"], ["--mtu", "68..65535"], id="mtu-small"),
    case(["--mtu", "9000"], ["--mtu", "--link"], id="mtu-without-link"),
    case(["--burst", "64kb"], ["--burst", "--link"], id="burst-without-link"),
    case(["--link", "1gbit", "--burst", "100"], ["--burst", "1514"], id="burst-below-frame"),
    case(["--link", "1gbit", "--burst", "0"], ["--burst", "positive"], id="burst-zero"),
    case(["--timeout", "-5"], ["--timeout", "> 0", "no limit"], id="timeout-negative"),
    case(["--timeout", "nan"], ["--timeout", "> 0"], id="timeout-nan"),
    case(["--grace", "-1"], ["--grace", ">= 0"], id="grace-negative"),
    case(["--grace", "nan"], ["--grace", ">= 0"], id="grace-nan"),
    case(["--port", "70000"], ["--port", "1..65535"], id="port"),
    case(["--restarts", "-1"], ["--restarts", ">= 0"], id="restarts"),
    case(["--nproc", "300", "--link", "1gbit"], ["--nproc", "1..240", "300"], id="nproc-over-link-limit"),
    case(["--all"], ["--all", "--cleanup"], id="all-without-cleanup"),
]


@pytest.mark.parametrize(("options", "fragments"), LAUNCH_CASES)
def test_launch_cli_refuses(run_cli: Callable, options: list[str], fragments: list[str]) -> None:
    check_cli(run_cli, ["launch", *options, "--", "true"], fragments)


def test_launch_cli_without_a_command(run_cli: Callable) -> None:
    check_cli(run_cli, ["launch", "--nproc", "2"], ["no command", "--"])


# train and compare share their run options; the checks compare does before training are what
# TrainConfig / train_cli leave to the ranks today
NO_DATA = "(LIONCUB_DATA=nowhere)"  # marker: run with $LIONCUB_DATA pointing at a missing folder

RUN_CASES = [  # (options, fragments): refused by `lioncub train` and `lioncub compare` before any launch
    (["--steps", "-3"], ["--steps", ">= 1"]),
    (["--variant", "3bit"], ["--variant", "3bit", "'8bit'"]),
    (["--size", "huge"], ["--size", "huge", "tiny"]),
    (["--workload", "mlp"], ["--workload", "gpt"]),
    (["--set", "nosuch=1"], ["--set", "nosuch", "n_embd"]),
    (["--set", "batch_size"], ["--set", "FIELD=VALUE"]),
    (["--quantizer", "l9"], ["--quantizer", "l9", "l1"]),
    (["--min-lr-ratio", "2"], ["--min-lr-ratio", "[0, 1]"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--eval-every", "-1"], ["--eval-every", ">= 0"]),
    (["--data-mode", "sequential"], ["--data-mode", "shard"]),
    (["--link", "10furlongs"], ["--link", "furlongs", "gbit"]),
    (["--link", "0mbit"], ["--link", "positive"]),
    (["--nproc", "300", "--link", "1gbit"], ["--nproc", "1..240"]),
    (["--timeout", "-5"], ["--timeout", "> 0"]),
    (["--bucket-mb", "0"], ["--bucket-mb", "> 0"]),
    (["--bucket-mb", "nan"], ["--bucket-mb", "> 0"]),
    (["--sync-every", "0"], ["--sync-every", ">= 1"]),
    (["--diagnostics-every", "-1"], ["--diagnostics-every", ">= 0"]),
    (["--momentum-sync", ""], ["--momentum-sync", "none, all, io"]),
    (["--seed", "-1"], ["--seed", ">= 0"]),
    (["--warmup", "1000", "--steps", "200"], ["--warmup 1000", "--steps 200"]),
    (["--set", "n_embd=-1"], ["--set", "n_embd=-1", ">= 1"]),
    (["--set", "n_head=3"], ["--set", "n_head=3", "multiple"]),
    (["--set", "corpus=nonexist"], ["--set", "corpus='nonexist'", "shakespeare"]),
    (["--set", "dropout=1.5"], ["--set", "dropout=1.5", "[0, 1)"]),
    (["--size", "small", NO_DATA], ["--size small", "shakespeare.txt", "LIONCUB_DATA="]),
    (["--variant", "8bit", "--zero-vote", "plus"], ["--zero-vote plus", "8bit", "one-bit votes"]),
    (["--inner-momentum", "average"], ["--inner-momentum", "only with --local-steps"]),
    (  # torchft's replica groups vote over gloo on CPU tensors
        ["--fault-tolerant", "--device", "cuda"],
        ["--device cuda with --fault-tolerant", "CPU tensors", "CUDA is not supported", "--device cpu"],
    ),
]
#: a sharded run's nodes (--fsdp: each node shards the model over its 2 ranks)
FSDP = ["--nnodes", "2", "--nproc-per-node", "2", "--link", "1gbit", "--fsdp"]
#: refused by `lioncub train` only (compare names local steps in --variants: COMPARE_CASES)
TRAIN_CASES = [
    (["--local-steps", "0"], ["--local-steps", ">= 1"]),
    (["--outer", "diloco"], ["--outer", "only with --local-steps"]),
    (["--outer-lr", "2"], ["--outer-lr", "only with --local-steps"]),
    (["--local-steps", "4", "--outer-lr", "-1"], ["--outer-lr", "> 0"]),
    (["--outer-betas", "0.5,0.9"], ["--outer-betas", "only with --local-steps"]),
    (["--local-steps", "4", "--outer-betas", "0.5"], ["--outer-betas: '0.5'", "two numbers B1,B2"]),
    (["--local-steps", "4", "--outer-betas", "0.5,x"], ["--outer-betas: '0.5,x'", "two numbers B1,B2"]),
    (["--local-steps", "4", "--outer-betas", "0.5,1"], ["--outer-betas", "[0, 1)"]),
    (["--local-steps", "16"], ["--steps 200 with --local-steps 16", "multiple of 16"]),
    (["--local-steps", "4", "--eval-every", "10"], ["--eval-every 10", "multiple of 4"]),
    (
        ["--variant", "1bit", "--local-steps", "4", "--outer", "dsm"],
        ["--outer dsm", "--variant 32bit or --variant 16bit", "not --variant 1bit"],
    ),
    (
        ["--variant", "1bit", "--local-steps", "4", "--momentum-sync", "all"],
        ["--momentum-sync", "--local-steps"],
    ),
    (["--variant", "1bit", "--local-steps", "4", "--overlap"], ["--overlap with --local-steps 4"]),
    (["--variant", "auto", "--local-steps", "4"], ["--variant auto with --local-steps 4", "chooses H"]),
    (["--variant", "auto", "--outer", "diloco"], ["--variant auto with --outer diloco", "--variant 32bit"]),
    (["--variant", "auto", "--resume"], ["--variant auto with --resume", "resume without --variant"]),
    (
        ["--variant", "auto", "--steps", "200"],
        ["--variant auto (it may choose 1bit/h16)", "--steps 200", "multiple of 16"],
    ),
    (["--variant", "1bit", "--fsdp"], ["--fsdp without --nnodes", "--nproc-per-node L with L >= 2"]),
    (
        ["--variant", "1bit", "--fsdp", "--nnodes", "4", "--nproc-per-node", "1", "--link", "1gbit"],
        ["--fsdp with --nproc-per-node 1", "L >= 2"],
    ),
    ([*FSDP, "--variant", "1bit", "--overlap"], ["--fsdp with --overlap", "drop --overlap"]),
    (
        [*FSDP, "--variant", "1bit", "--topology", "hierarchical"],
        ["--fsdp with --topology hierarchical", "--topology flat or auto"],
    ),
    (
        [*FSDP, "--variant", "1bit", "--diagnostics-every", "2"],
        ["--fsdp with --diagnostics-every 2", "--diagnostics-every 0"],
    ),
    (
        [*FSDP, "--variant", "1bit", "--convert-momenta", "average"],
        ["--fsdp with --convert-momenta average", "same --nnodes and --nproc-per-node"],
    ),
    ([*FSDP, "--variant", "auto"], ["--variant auto with --fsdp", "give the variant"]),
]


def _run_options(options: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    if options[-1] == NO_DATA:  # an unreadable data path: $LIONCUB_DATA points nowhere
        monkeypatch.setenv("LIONCUB_DATA", str(tmp_path / "no-such-data"))
        options = options[:-1]
    return options


@pytest.mark.parametrize(
    ("options", "fragments"),
    [case(o, f, id=" ".join(o)[:40]) for o, f in RUN_CASES + TRAIN_CASES],
)
def test_train_cli_refuses_before_writing_or_launching(
    run_cli: Callable,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    fragments: list[str],
) -> None:
    out = tmp_path / "run"
    options = _run_options(options, tmp_path, monkeypatch)
    check_cli(run_cli, ["train", "--out", str(out), "--no-progress", *options], fragments)
    assert not (out / "config.json").exists(), "refused only after writing OUT/config.json"


def test_train_cli_resume_without_a_run(run_cli: Callable, tmp_path: Path) -> None:
    check_cli(run_cli, ["train", "--out", str(tmp_path), "--resume"], ["--resume", "config.json"])


COMPARE_CASES = [
    *[case(o, f, id=" ".join(o)[:40]) for o, f in RUN_CASES if o[0] != "--variant"],
    case(["--variants", "32bit,3bit"], ["--variants", "3bit", "'8bit'"], id="variants-unknown"),
    case(["--variants", "1bit,1bit"], ["--variants", "distinct"], id="variants-twice"),
    case(["--variants", ","], ["--variants", "'32bit'"], id="variants-empty"),
    case(["--variants", "1bit@ring"], ["--variants", "@TOPOLOGY", "'node-majority'"], id="variants-topology"),
    case(
        ["--variants", "32bit@hierarchical"], ["--topology hierarchical", "DDP"], id="variants-topology-ddp"
    ),
    case(["--variants", "1bit/16"], ["--variants", "hH", "1bit/h16"], id="variants-local-h"),
    case(["--variants", "1bit/h4/x2"], ["--variants", "/lrX"], id="variants-local-lr"),
    case(["--variants", "32bit/h4"], ["--variants", "dsm/h4", "diloco/h4"], id="variants-local-32bit"),
    case(["--variants", "1bit/h4/keep/lr2"], ["--variants", "in this order", "/lrX"], id="variants-order"),
    case(
        ["--variants", "8bit/plus"], ["--variants 8bit/plus", "--zero-vote plus", "one-bit"], id="plus-8bit"
    ),
    case(
        ["--variants", "8bit/h16"], ["--variants 8bit/h16", "--steps 200", "multiple of 16"], id="local-steps"
    ),
    case(["--variants", "dsm/h4/lr0"], ["--variants dsm/h4/lr0", "--outer-lr", "> 0"], id="local-outer-lr"),
    case(
        ["--variants", "diloco-8bit/h4"],
        ["diloco-8bit/h4", "--outer diloco", "32bit or --variant 16bit"],
        id="dil-8",
    ),
    case(
        ["--variants", "32bit,8bit", "--zero-vote", "plus"],
        ["--zero-vote plus", "one-bit"],
        id="zero-vote-no-1bit",
    ),
    case(
        ["--variants", "1bit,auto", "--steps", "200"],
        ["--variants auto (it may choose 1bit/h16)", "multiple of 16"],
        id="auto-steps",
    ),
    case(
        ["--variants", "1bit,8bit@hierarchical+fsdp", *FSDP[:-1]],
        ["--variants 8bit@hierarchical+fsdp", "--fsdp with --topology hierarchical"],
        id="fsdp-topology",
    ),
    case(["--variants", "1bit+fsdp"], ["--fsdp without --nnodes"], id="fsdp-no-nodes"),
    case(["--target-loss", "nan"], ["--target-loss", "> 0"], id="target-loss-nan"),
    *[
        case(["--time-budget", v], ["--time-budget", v, "seconds > 0"], id=f"time-budget-{v}")
        for v in ("0", "-5", "nan", "inf")
    ],
    case(
        ["--time-budget", "60", "--steps", "50"], ["--time-budget 60", "--steps 50"], id="time-budget-steps"
    ),
    case(
        ["--time-budget", "60", "--diagnostics-every", "2"],
        ["--diagnostics-every 2", "--time-budget 60"],
        id="time-budget-diagnostics",
    ),
    case(
        ["--time-budget", "60", "--report-only"],
        ["--time-budget 60", "--report-only"],
        id="time-budget-report",
    ),
    case(["--target-loss", "-1"], ["--target-loss", "> 0"], id="target-loss-negative"),
]


@pytest.mark.parametrize(("options", "fragments"), COMPARE_CASES)
def test_compare_cli_refuses_before_training(
    run_cli: Callable,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    fragments: list[str],
) -> None:
    out = tmp_path / "cmp"
    options = _run_options(options, tmp_path, monkeypatch)
    if "--variants" not in options:
        options = ["--variants", "32bit,1bit", *options]
    check_cli(run_cli, ["compare", "--out", str(out), "--no-progress", *options], fragments)
    assert not out.exists(), "refused only after creating run directories"


COST = ["cost", "--params", "774M", "--workers", "4"]
COST_CASES = [
    case(["cost", "--params", "0", "--workers", "4"], ["--params", ">= 1"], id="params-0"),
    case(["cost", "--params", "774Q", "--workers", "4"], ["--params", "774M"], id="params-unit"),
    case(["cost", "--params", "1e400", "--workers", "4"], ["--params", "finite"], id="params-huge"),
    case(["cost", "--params", "774M", "--workers", "0"], ["--workers", "whole number >= 1"], id="workers-0"),
    case([*COST, "--bandwidth", "10furlongs"], ["--bandwidth", "furlongs", "gbit"], id="bandwidth-unit"),
    case([*COST, "--bandwidth", "0gbit"], ["--bandwidth", "positive"], id="bandwidth-zero"),
    case([*COST, "--latency", "5"], ["--latency", "50us"], id="latency-no-unit"),
    case([*COST, "--latency", "1e400s"], ["--latency", "finite"], id="latency-huge"),
    case([*COST, "--efficiency", "0"], ["--efficiency", "(0, 1]"], id="efficiency-0"),
    case([*COST, "--efficiency", "nan"], ["--efficiency", "(0, 1]"], id="efficiency-nan"),
    case(
        [*COST, "--calibration", "/nonexistent/c.json"],
        ["--calibration", "/nonexistent/c.json"],
        id="calib-missing",
    ),
    case([*COST, "--compute", "gpu"], ["--compute", "'cpu'"], id="compute"),
    case([*COST, "--bucket-mb", "-1"], ["--bucket-mb", ">= 0"], id="bucket-negative"),
    case([*COST, "--bucket-mb", "0.000001"], ["--bucket-mb", "or 0"], id="bucket-tiny"),
    case([*COST, "--sync-every", "0"], ["--sync-every", ">= 1"], id="sync-every-0"),
    case([*COST, "--sync-params", "1M"], ["--sync-params", "--sync-every"], id="sync-params-alone"),
    case(
        [*COST, "--sync-every", "10", "--sync-params", "1B"],
        ["--sync-params", "--params 774M"],
        id="sync-params-big",
    ),
    case([*COST, "--variants", "3bit"], ["--variants", "3bit", "8bit"], id="variants-unknown"),
    case(
        ["cost", "--params", "774M", "--workers", "200", "--variants", "8bit"],
        ["--variants", "--workers 200", "1bit"],
        id="variants-none-allowed",
    ),
    case([*COST, "--plot", "/nonexistent/dir/x.png"], ["--plot", "/nonexistent/dir"], id="plot-no-dir"),
    case([*COST, "--plot", "cost.txtx"], ["--plot", "txtx", "png"], id="plot-format"),
]


@pytest.mark.parametrize(("argv", "fragments"), COST_CASES)
def test_cost_cli_refuses(run_cli: Callable, argv: list[str], fragments: list[str]) -> None:
    check_cli(run_cli, argv, fragments)


def test_cost_cli_names_a_bad_calibration_file(run_cli: Callable, tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    check_cli(run_cli, [*COST, "--calibration", str(bad)], ["--calibration", str(bad), "JSON"])


CALIBRATE_CASES = [
    case(["--nproc", "0"], ["--nproc", ">= 1"], id="nproc-0"),
    case(["--nproc", "1"], ["--nproc 1", "at least 2"], id="nproc-1"),
    case([], ["--nproc", "lioncub launch"], id="no-job"),
    case(["--nproc", "2", "--repeats", "0"], ["--repeats", ">= 1"], id="repeats-0"),
    case(["--nproc", "2", "--warmup", "-1"], ["--warmup", ">= 0"], id="warmup-negative"),
    case(["--nproc", "2", "--timeout", "-5"], ["--timeout", "> 0"], id="timeout-negative"),
    case(["--nproc", "2", "--timeout", "nan"], ["--timeout", "> 0"], id="timeout-nan"),
    case(["--nproc", "2", "--sizes", "1kb"], ["--sizes", "two distinct"], id="sizes-one"),
    case(["--nproc", "2", "--sizes", "1kb,0"], ["--sizes", "positive"], id="sizes-zero"),
    case(["--nproc", "2", "--ops", "allgather"], ["--ops", "allreduce_f32"], id="ops-unknown"),
    case(
        ["--nproc", "2", "--ops", "all_gather"], ["--ops", "allreduce_f32", "--link"], id="ops-no-reference"
    ),
    case(["--nproc", "2", "--compute-numel", "4Q"], ["--compute-numel", "774M"], id="compute-numel"),
    case(["--nproc", "2", "--link", "10furlongs"], ["--link", "furlongs", "gbit"], id="link-unit"),
    case(["--nproc", "300", "--link", "1gbit"], ["--nproc", "1..240"], id="nproc-over-link-limit"),
]


@pytest.mark.parametrize(("options", "fragments"), CALIBRATE_CASES)
def test_calibrate_cli_refuses(
    run_cli: Callable, tmp_path: Path, options: list[str], fragments: list[str]
) -> None:
    check_cli(run_cli, ["calibrate", "--out", str(tmp_path / "c.json"), *options], fragments)


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_calibrate_cli_refuses_an_unwritable_out(run_cli: Callable, tmp_path: Path, where: str) -> None:
    out = tmp_path / "no" / "c.json" if where == "missing-dir" else tmp_path
    check_cli(run_cli, ["calibrate", "--out", str(out), "--nproc", "2"], ["--out", str(out)])


def test_report_cli_refuses(run_cli: Callable, tmp_path: Path) -> None:
    check_cli(run_cli, ["report", str(tmp_path / "nope")], ["RUN_DIR", "not a directory"])
    (tmp_path / "log.jsonl").write_text('{"kind": "diag", "step": 1\n')
    check_cli(run_cli, ["report", str(tmp_path)], ["RUN_DIR", "log.jsonl", "not JSON"])
    (tmp_path / "file").write_text("")
    check_cli(
        run_cli, ["report", str(tmp_path), "--out", str(tmp_path / "file")], ["--out", "not a directory"]
    )
    check_cli(
        run_cli,
        ["report", str(tmp_path), "--out", str(tmp_path / "file" / "x")],
        ["--out", "not a directory"],
    )
