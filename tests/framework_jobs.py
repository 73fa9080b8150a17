"""The ranks' side of tests/test_integrations.py: many scenarios of one framework in ONE job of 2 ranks
(importing a framework costs seconds per process), each rank writing what it saw per scenario.

    cd tests && python -m lioncub launch --nproc 2 -- -m framework_jobs {hf,accelerate,lightning} OUT

(the tests' background job runs every framework's jobs from one runner, :func:`run_job`; by hand:
``python framework_jobs.py --sequences OUT 240 hf accelerate lightning``).

Every scenario trains a tiny model for a few steps with LionCub through the framework's own API and
writes ``OUT/<scenario>.rank<r>.pt``: ``{"ok": {...}}`` (final parameters and this rank's momenta, the
first step's local gradients, the lr and the largest update of every step, logs) or ``{"error": text}``.
Scenarios named ``<name>-resume`` start from the checkpoint ``<name>`` wrote after ``SAVE_AT`` steps,
through the framework's resume path. The test compares the files.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import runpy
import shlex
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from lioncub import LionCub
from lioncub.launch.preload import end_rank

STEPS = 6  # optimizer steps of a full run
SAVE_AT = 3  # the checkpoint a "-resume" scenario starts from
ACCUM = 2  # gradient accumulation of every run but the "-big" one
BATCH = 2  # per rank and micro-batch ("-big": ACCUM * BATCH, no accumulation)
LR = 1e-3
WEIGHT_DECAY = 0.1
VOCAB, SEQ = 64, 8
LOCAL_H = 2  # the local-steps runs' H: SAVE_AT is in the middle of a window
#: the local-steps runs' settings: the inner momenta kept, so each rank's stays its own across windows
LOCAL = {"h": LOCAL_H, "inner_momentum": "keep"}
REPO = Path(__file__).resolve().parents[1]


# -- shared pieces ------------------------------------------------------------------------------------


def rank() -> int:
    return int(os.environ["RANK"])


def tokens(n: int = STEPS * ACCUM * BATCH * 2) -> torch.Tensor:
    """int64 ``[n, SEQ]`` random tokens, the same on every rank (the framework's sampler shards them)."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))


class TinyLM(nn.Module):
    """Embedding → LayerNorm → Linear → GELU → Linear head: weights (decayed) and biases/norms (not)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.hidden(self.norm(self.emb(x)))))


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``x`` (int64 ``[batch, SEQ]``), through ``model``'s own forward (a DDP
    model's forward prepares its backward)."""
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def tiny_lm() -> TinyLM:
    torch.manual_seed(rank())  # different on every rank: LionCub/DDP broadcast rank 0's
    return TinyLM()


def readme_model() -> nn.Module:
    """The README reader's ``build_model()``: int64 ``[batch, SEQ]`` tokens -> ``[batch, VOCAB]`` logits."""
    torch.manual_seed(rank())
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Linear(8 * SEQ, VOCAB))


class CountedPairs(torch.utils.data.TensorDataset):
    """A ``TensorDataset`` that counts the samples read from it (``reads``)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.reads = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.reads += 1
        return super().__getitem__(index)


def readme_loader() -> Any:
    """The README reader's ``loader``: batches of 8 ``(x, y)`` pairs (a :class:`CountedPairs`)."""
    from torch.utils.data import DataLoader

    x = tokens()
    return DataLoader(CountedPairs(x, x.sum(1) % VOCAB), batch_size=8)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices, none on biases and norms (what the Trainer does)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


class Recorder:
    """Step hooks on a LionCub: the lr of every group and the largest |Δp| of the undecayed group per step
    (= the lr a sign update applied), the first step's local gradients, and the ``.grad`` of every step."""

    def __init__(self, opt: LionCub, model: nn.Module, *, grads_at_step: bool = True) -> None:
        self.opt, self.group, self.grads_at_step = opt, 1, grads_at_step
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.lrs: list[list[float]] = []
        self.deltas: list[float] = []
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.sums: list[tuple[float, float]] = []
        self._before: list[torch.Tensor] = []
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)

    def grads_now(self) -> None:
        """Record the gradients (call it where the framework has them, before the step's apply): all of
        them at the first step, their float64 sum of |g| and of the parameters at every step."""
        grads = [p.grad for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        params = [p.detach() for g in self.opt.param_groups for p in g["params"]]
        self.sums.append(
            (
                sum(float(g.double().abs().sum()) for g in grads),
                sum(float(p.double().abs().sum()) for p in params),
            )
        )
        if self.first_grads is None:
            self.first_grads = {
                self.names[id(p)]: p.grad.detach().clone()
                for g in self.opt.param_groups
                for p in g["params"]
                if p.grad is not None
            }

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.grads_at_step:
            self.grads_now()
        self.lrs.append([float(g["lr"]) for g in opt.param_groups])
        self._before = [p.detach().clone() for p in opt.param_groups[self.group]["params"]]

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        after = [p.detach() for p in opt.param_groups[self.group]["params"]]
        self.deltas.append(max(float((a - b).abs().max()) for a, b in zip(after, self._before, strict=True)))

    def result(self, model: nn.Module, **extra: Any) -> dict[str, Any]:
        named = dict(model.named_parameters())
        return {
            "params": {n: p.detach().clone() for n, p in named.items()},
            "momenta": momenta(self.opt, model),
            "opt_step": self.opt.global_step,
            "lrs": self.lrs,
            "deltas": self.deltas,
            "first_grads": self.first_grads,
            "sums": self.sums,
            "bytes_last": self.opt.comm_stats()["last"]["bytes_sent"],
            "overlapped_s": self.opt.comm_stats()["total"]["overlapped_s"],
            "overlapping": self.opt.overlap_hook is not None,
            "groups": [
                (sorted(self.names[id(p)] for p in g["params"]), g["weight_decay"])
                for g in self.opt.param_groups
            ],
            **extra,
        }


def momenta(opt: LionCub, model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's momenta, by parameter name (those that have one)."""
    named = model.named_parameters()
    return {n: opt.state[p]["exp_avg"].clone() for n, p in named if "exp_avg" in opt.state[p]}


def run_scenarios(scenarios: dict[str, Callable[[Path], dict[str, Any]]], out: Path, only: list[str]) -> None:
    """Run each scenario on every rank; write its result or its traceback. A failing scenario does not stop
    the others (the ranks fail alike, since they run the same code on the same schedule)."""
    for name, fn in scenarios.items():
        if only and name not in only:
            continue
        workdir = out / "work"
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            result: dict[str, Any] = {"ok": fn(workdir)}
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, out / f"{name}.rank{rank()}.pt")
        print(f"scenario {name}: {'ok' if 'ok' in result else 'FAILED'}", flush=True)


def readme_block(tag: str) -> str:
    """The README's code block fenced as ````python <tag>``."""
    blocks = re.findall(r"```python (\S+)\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    found = [code for t, code in blocks if t == tag]
    assert len(found) == 1, f"README: {len(found)} blocks tagged python {tag}"
    return found[0]


def run_readme(
    tag: str,
    names: dict[str, Any],
    workdir: Path,
    probe: Callable[[dict[str, Any]], dict[str, Any]] = lambda namespace: {},
) -> dict[str, Any]:
    """Run the README block ``tag`` with the reader's own ``names`` (their model, data...), in ``workdir``;
    ``probe`` reads what it needs from the block's namespace afterwards."""
    here = Path.cwd()
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    namespace = dict(names)
    try:
        exec(compile(readme_block(tag), f"README.md[python {tag}]", "exec"), namespace)
    finally:
        os.chdir(here)
    return {"ran": tag, **probe(namespace)}


def expect_error(fn: Callable[[], Any]) -> str:
    """The message of the exception ``fn`` raises (``""`` if none)."""
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


# -- Hugging Face Trainer -----------------------------------------------------------------------------


def hf_kit() -> SimpleNamespace:
    """The Trainer runs: ``data``, ``model(dropout)``, ``args(out, **kw)``, ``train(out, variant, overlap,
    ...)``, ``LionCubTrainer``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from lioncub.integrations.hf import LionCubCallback, LionCubTrainer

    data = [{"input_ids": t, "labels": t} for t in tokens()]

    def model(dropout: float = 0.1) -> GPT2LMHeadModel:
        """GPT-2 with 1 layer of 16 wide; dropout (GPT-2's default 0.1) on: the resumed runs depend on the
        Trainer restoring every rank's RNG."""
        torch.manual_seed(rank())
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=1,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
        return GPT2LMHeadModel(cfg)

    def args(out: Path, **kw: Any) -> TrainingArguments:
        base: dict[str, Any] = dict(
            output_dir=str(out),
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUM,
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            lr_scheduler_type="linear",
            warmup_steps=0,
            save_strategy="steps",
            save_steps=SAVE_AT,
            logging_steps=1,
            report_to="none",
            seed=7,
            dataloader_num_workers=0,
            disable_tqdm=True,
            use_cpu=True,
        )
        return TrainingArguments(**{**base, **kw})

    class OwnTrainer(Trainer):
        """A user's own Trainer subclass (the callback path)."""

    class Probe(TrainerCallback):
        """This rank's momenta when training begins (after a resume loaded them) and after step SAVE_AT."""

        def __init__(self, opt: LionCub, model: nn.Module) -> None:
            self.opt, self.model = opt, model
            self.seen: dict[str, Any] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seen["momenta_loaded"] = momenta(self.opt, self.model)
            self.seen["opt_step_loaded"] = self.opt.global_step

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == SAVE_AT:
                self.seen["momenta_saved"] = momenta(self.opt, self.model)

    def train(
        out: Path,
        variant: str,
        overlap: bool,
        *,
        callback: bool,
        resume: bool = False,
        dropout: float = 0.1,
        lioncub: dict[str, Any] | None = None,
        late: tuple[TrainerCallback, ...] = (),
        evaluate: bool = False,
        build: Callable[[], nn.Module] | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        """A run of ``STEPS``: ``lioncub`` adds LionCubTrainer options, ``late`` are callbacks added after
        the Trainer was built, ``evaluate`` gives it an eval set; ``resume`` starts from ``out``'s
        checkpoint-SAVE_AT; ``build`` makes another model than GPT-2. Adds the wrapped model's type, the
        warnings and :class:`Probe`'s momenta."""
        m = build() if build is not None else model(dropout)
        a = args(out, **kw)
        extra: dict[str, Any] = {"eval_dataset": data[: 2 * BATCH]} if evaluate else {}
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if callback:
                trainer: Trainer = OwnTrainer(model=m, args=a, train_dataset=data, **extra)
                cb = LionCubCallback(trainer, overlap=overlap, variant=variant)
                trainer.add_callback(cb)
            else:
                options = dict(variant=variant, overlap=overlap, **(lioncub or {}))
                trainer = LionCubTrainer(model=m, args=a, train_dataset=data, lioncub=options, **extra)
                cb = trainer.lioncub_callback
            for late_callback in late:
                trainer.add_callback(late_callback)
            trainer.create_optimizer()
            opt = cb.optimizer
            recorder, probe = Recorder(opt, m), Probe(opt, m)
            trainer.add_callback(probe)
            trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}") if resume else None)
        logs = [e for e in trainer.state.log_history if "loss" in e]
        evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
        return recorder.result(
            m,
            logs=logs,
            evals=evals,
            decay=sorted(trainer.get_decay_parameter_names(m)),
            wrapped=type(trainer.model_wrapped).__name__,
            warned=[str(w.message) for w in warned],
            **probe.seen,
        )

    return SimpleNamespace(data=data, model=model, args=args, train=train, LionCubTrainer=LionCubTrainer)


def hf_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    kit = hf_kit()
    data, model, args, train, LionCubTrainer = kit.data, kit.model, kit.args, kit.train, kit.LionCubTrainer

    scenarios: dict[str, Callable[[Path], dict[str, Any]]] = {}
    for variant in ("1bit", "8bit"):
        for overlap in (False, True):
            name = f"{variant}-{'overlap' if overlap else 'plain'}"
            # 8bit runs through a Trainer subclass + LionCubCallback, 1bit through LionCubTrainer;
            # plain runs clip (the Trainer's default max_grad_norm=1.0); overlap needs max_grad_norm=0
            kw: dict[str, Any] = dict(callback=variant == "8bit", max_grad_norm=0.0 if overlap else 1.0)
            scenarios[name] = lambda w, v=variant, o=overlap, kw=kw, n=name: train(w / n, v, o, **kw)
            scenarios[f"{name}-resume"] = lambda w, v=variant, o=overlap, kw=kw, n=name: train(
                w / n, v, o, resume=True, **{**kw, "output_dir": str(w / f"{n}-resume")}
            )
    # one step of ACCUM micro-batches, and one of the same samples in one batch (no clipping)
    one_step = dict(callback=False, max_steps=1, max_grad_norm=0.0, save_strategy="no", dropout=0.0)
    # local steps, H = 2: the save after step 3 is in the middle of a window (the replicas differ there)
    local = dict(callback=False, lioncub={"local_steps": LOCAL})
    scenarios["local"] = lambda w: train(w / "local", "1bit", False, **local)
    scenarios["local-resume"] = lambda w: train(
        w / "local", "1bit", False, resume=True, output_dir=str(w / "local-resume"), **local
    )
    scenarios["accum"] = lambda w: train(w / "accum", "1bit", False, **one_step)
    scenarios["big"] = lambda w: train(
        w / "big",
        "1bit",
        False,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=ACCUM * BATCH,
        **one_step,
    )

    def refusals(w: Path) -> dict[str, Any]:
        overlap_clip = expect_error(
            lambda: LionCubTrainer(
                model=model(),
                args=args(w / "r"),
                train_dataset=data,
                lioncub=dict(variant="1bit", overlap=True),
            )
        )
        lr_option = expect_error(
            lambda: LionCubTrainer(
                model=model(), args=args(w / "r"), train_dataset=data, lioncub=dict(lr=1.0)
            )
        )
        return {"overlap_clip": overlap_clip, "lr_option": lr_option}

    scenarios["refusals"] = refusals

    def factory(w: Path) -> dict[str, Any]:
        """The optimizer factory the callback gives the Trainer, called both ways: ``factory()(model)``
        (transformers 5) and ``factory(groups)`` (a Trainer without factories)."""
        m = model()
        trainer = LionCubTrainer(
            model=m, args=args(w / "f"), train_dataset=data, lioncub=dict(variant="8bit")
        )
        factory, _ = trainer.optimizer_cls_and_kwargs
        by_model = factory()(m)
        by_groups = factory([{"params": list(m.parameters()), "weight_decay": 0.5}])
        return {
            "by_model": [(len(g["params"]), g["weight_decay"], g["betas"]) for g in by_model.param_groups],
            "by_groups": [(len(g["params"]), g["weight_decay"], g["lr"]) for g in by_groups.param_groups],
            "variants": [by_model.variant, by_groups.variant],
        }

    scenarios["factory"] = factory

    def example(w: Path) -> dict[str, Any]:
        ran = run_example_sequence("hf_trainer.py", w / "example")
        resumed = Path(ran["outs"][-1]) / f"checkpoint-{RESUMED_STEPS}" / "trainer_state.json"
        ran["final_step"] = json.loads(resumed.read_text())["global_step"]
        return ran

    scenarios["example"] = example
    scenarios["readme"] = lambda w: run_readme(
        "hf", {"torch": torch, "model": model(), "dataset": data}, w / "readme"
    )
    return scenarios


# -- accelerate ---------------------------------------------------------------------------------------


def accelerate_train(
    out: Path,
    variant: str,
    overlap: bool,
    *,
    resume: bool = False,
    steps: int = STEPS,
    accum: int = ACCUM,
    batch: int = BATCH,
    clip: bool = False,
    local_steps: dict[str, Any] | None = None,
    **accelerator_kw: Any,
) -> dict[str, Any]:
    """A run of ``steps`` through ``Accelerator(cpu=True, **accelerator_kw)`` and :func:`prepare`, saving
    its state after ``SAVE_AT`` steps (``resume``: starting from it); adds the prepared model's type."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import lioncub.integrations.accelerate as lioncub_accelerate

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum, **accelerator_kw)
    torch.manual_seed(7)  # the loader's shuffle: the same in both runs
    m = tiny_lm()
    opt = LionCub(param_groups(m), lr=LR, variant=variant, model=m, local_steps=local_steps)
    total = STEPS * accelerator.num_processes  # accelerate steps the scheduler once per process
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)
    loader = DataLoader(tokens(), batch_size=batch)
    pm, popt, ploader, psched = accelerator.prepare(m, opt, loader, sched)
    lioncub_accelerate.prepare(accelerator, pm, popt, overlap=overlap)
    recorder = Recorder(opt, m)
    done = 0
    if resume:
        accelerator.load_state(str(out / "state"))
        done = SAVE_AT
        ploader = accelerator.skip_first_batches(ploader, SAVE_AT * accum)
    batches = iter(ploader)
    while done < steps:
        with accelerator.accumulate(pm):
            accelerator.backward(lm_loss(pm, next(batches)))
            if accelerator.sync_gradients and clip:
                accelerator.clip_grad_norm_(pm.parameters(), 1.0)
            popt.step()
            psched.step()
            popt.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if done == SAVE_AT - 1:  # the last outer step before the save (H = 2 for the local runs)
                before_save = {n: p.detach().clone() for n, p in m.named_parameters()}
            if done == SAVE_AT and not resume and steps == STEPS:
                accelerator.save_state(str(out / "state"))
    extra: dict[str, Any] = {}
    if local_steps is not None and not resume:  # the model save_state wrote (a window's middle): θ
        from safetensors.torch import load_file

        saved = load_file(str(out / "state" / "model.safetensors"))
        extra = {
            "saved_model": {k.removeprefix("module."): v for k, v in saved.items()},
            "before_save": before_save,
        }
    return recorder.result(m, wrapped=type(pm).__name__, **extra)


def accelerate_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    import lioncub.integrations.accelerate as lioncub_accelerate

    train = accelerate_train
    scenarios: dict[str, Callable[[Path], dict[str, Any]]] = {}
    for variant in ("1bit", "8bit"):
        for overlap in (False, True):
            name = f"{variant}-{'overlap' if overlap else 'plain'}"
            clip = not overlap
            scenarios[name] = lambda w, v=variant, o=overlap, c=clip, n=name: train(w / n, v, o, clip=c)
            scenarios[f"{name}-resume"] = lambda w, v=variant, o=overlap, c=clip, n=name: train(
                w / n, v, o, clip=c, resume=True
            )
    scenarios["local"] = lambda w: train(w / "local", "1bit", False, local_steps=LOCAL)
    scenarios["local-resume"] = lambda w: train(w / "local", "1bit", False, local_steps=LOCAL, resume=True)
    scenarios["accum"] = lambda w: train(w / "accum", "1bit", False, steps=1)
    scenarios["big"] = lambda w: train(w / "big", "1bit", False, steps=1, accum=1, batch=ACCUM * BATCH)

    def comm_hook(w: Path) -> dict[str, Any]:
        def my_hook(state: Any, bucket: Any) -> Any:
            raise AssertionError("never called")

        accelerator = Accelerator(
            cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=my_hook)]
        )
        m = tiny_lm()
        pm, popt = accelerator.prepare(m, LionCub(m.parameters(), lr=LR, variant="1bit"))
        return {"message": expect_error(lambda: lioncub_accelerate.prepare(accelerator, pm, popt))}

    scenarios["comm_hook"] = comm_hook
    scenarios["readme"] = lambda w: run_readme(
        "accelerate",
        {"torch": torch, "LionCub": LionCub, "model": readme_model(), "loader": readme_loader()},
        w / "readme",
    )
    return scenarios


def accelerate_example_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    """The commands of ``examples/accelerate_loop.py``'s docstring, one per launch as a user runs them
    (``example-1``, ``example-2``, then ``example``: the resume). Not in one process: the example ends
    the process group (``accelerator.end_training``), and a second ``init_process_group`` in the same
    launch reuses the first one's keys in the launcher's store (torch names the default group the same
    each time), so a rank may read its peer's stale gloo address and both hang in the first collective."""
    name = "accelerate_loop.py"

    def command(i: int) -> Callable[[Path], dict[str, Any]]:
        def run(w: Path) -> dict[str, Any]:
            commands = shrunk_example_commands(name, w / "example")
            run_example(name, commands[i])
            outs = [argv[argv.index("--out") + 1] for argv in commands]
            return {"ran": name, "outs": outs, "final_step": int((Path(outs[i]) / "step.txt").read_text())}

        return run

    count = len(example_commands(name))
    return {**{f"example-{i + 1}": command(i) for i in range(count - 1)}, "example": command(count - 1)}


# -- Lightning ----------------------------------------------------------------------------------------


def lightning_kit() -> SimpleNamespace:
    """The Lightning runs: ``train(out, variant, overlap, ...)`` and ``LionCubStrategy``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lioncub.integrations.lightning import LionCubStrategy

    class Module(pl.LightningModule):
        def __init__(self, variant: str, local_steps: dict[str, Any] | None) -> None:
            super().__init__()
            self.variant, self.local_steps = variant, local_steps
            self.net = tiny_lm()
            self.recorder: Recorder | None = None
            self.clipped: list[float] = []  # the gradients' L2 norm after each step's clipping
            self.validated: list[tuple[int, list[torch.Tensor]]] = []  # (step, the parameters validated)
            self.after: dict[int, list[torch.Tensor]] = {}  # the parameters after each optimizer step

        def configure_gradient_clipping(
            self,
            optimizer: torch.optim.Optimizer,
            gradient_clip_val: Any = None,
            gradient_clip_algorithm: Any = None,
        ) -> None:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            grads = [p.grad.double() for p in self.net.parameters() if p.grad is not None]
            self.clipped.append(float(torch.stack([g.norm() for g in grads]).norm()))

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return lm_loss(self.net, batch)

        def validation_step(self, batch: torch.Tensor, index: int) -> None:
            self.validated.append((self.global_step, [p.detach().clone() for p in self.net.parameters()]))

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            self.after[self.global_step] = [p.detach().clone() for p in self.net.parameters()]

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            assert self.recorder is not None
            self.recorder.grads_now()

        def configure_optimizers(self) -> dict[str, Any]:
            opt = LionCub(
                param_groups(self.net),
                lr=LR,
                variant=self.variant,
                model=self.net,
                local_steps=self.local_steps,
            )
            self.recorder = Recorder(
                opt, self.net, grads_at_step=False
            )  # the closure's backward is in step()
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # one epoch = SAVE_AT optimizer steps (2 ranks)
    per_epoch = SAVE_AT * ACCUM * BATCH * 2

    def train(
        out: Path,
        variant: str,
        overlap: bool,
        *,
        resume: bool = False,
        clip: float | None = None,
        steps: int = STEPS,
        accum: int = ACCUM,
        batch: int = BATCH,
        local_steps: dict[str, Any] | None = None,
        validate: bool = False,
        **trainer_kw: Any,
    ) -> dict[str, Any]:
        """A run of ``steps`` with ``LionCubStrategy``, checkpointed every ``SAVE_AT`` steps (``resume``: from
        the first); ``trainer_kw`` go to ``pl.Trainer`` (``precision``, ``gradient_clip_algorithm``)."""
        module = Module(variant, local_steps)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            max_steps=steps,
            strategy=LionCubStrategy(overlap=overlap, process_group_backend="gloo"),
            accumulate_grad_batches=accum,
            gradient_clip_val=clip,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(out),
            # saved after a batch: resuming from the epoch-end save that Lightning makes by default runs one
            # extra micro-batch step with accumulate_grad_batches (Lightning 2.6, with any strategy)
            callbacks=[
                ModelCheckpoint(
                    dirpath=str(out / ("ckpt-2" if resume else "ckpt")),
                    every_n_train_steps=SAVE_AT,
                    save_top_k=-1,
                )
            ],
            use_distributed_sampler=True,
            num_sanity_val_steps=0,
            **trainer_kw,
        )
        loader = DataLoader(tokens(per_epoch), batch_size=batch, shuffle=True)
        ckpt = str(out / "ckpt" / f"epoch=0-step={SAVE_AT}.ckpt") if resume else None
        pl.seed_everything(7, verbose=False)
        val = {"val_dataloaders": DataLoader(tokens(4), batch_size=2)} if validate else {}
        trainer.fit(module, loader, ckpt_path=ckpt, **val)
        assert module.recorder is not None
        scaler = type(getattr(trainer.precision_plugin, "scaler", None)).__name__
        extra: dict[str, Any] = {}
        if validate:  # what validation saw, the parameters after each step, the checkpoint's model
            saved = torch.load(
                out / "ckpt" / f"epoch=0-step={SAVE_AT}.ckpt", map_location="cpu", weights_only=False
            )
            extra = {
                "validated": module.validated,
                "after": module.after,
                "ckpt_model": [v for k, v in saved["state_dict"].items() if k.startswith("net.")],
            }
        return module.recorder.result(module.net, clipped=module.clipped, scaler=scaler, **extra)

    return SimpleNamespace(train=train, LionCubStrategy=LionCubStrategy)


def lightning_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    kit = lightning_kit()
    train, LionCubStrategy = kit.train, kit.LionCubStrategy
    scenarios: dict[str, Callable[[Path], dict[str, Any]]] = {}
    for variant in ("1bit", "8bit"):
        for overlap in (False, True):
            name = f"{variant}-{'overlap' if overlap else 'plain'}"
            clip = None if overlap else 1.0
            scenarios[name] = lambda w, v=variant, o=overlap, c=clip, n=name: train(w / n, v, o, clip=c)
            scenarios[f"{name}-resume"] = lambda w, v=variant, o=overlap, c=clip, n=name: train(
                w / n, v, o, clip=c, resume=True
            )
    scenarios["local"] = lambda w: train(w / "local", "1bit", False, clip=1.0, local_steps=LOCAL)
    scenarios["local-resume"] = lambda w: train(
        w / "local", "1bit", False, clip=1.0, local_steps=LOCAL, resume=True
    )
    scenarios["accum"] = lambda w: train(w / "accum", "1bit", False, steps=1)
    scenarios["big"] = lambda w: train(w / "big", "1bit", False, steps=1, accum=1, batch=ACCUM * BATCH)
    scenarios["refusals"] = lambda w: {
        "overlap_clip": expect_error(lambda: train(w / "r", "1bit", True, clip=1.0, steps=1)),
        "comm_hook": expect_error(lambda: LionCubStrategy(ddp_comm_hook=lambda s, b: None)),
    }

    def example(w: Path) -> dict[str, Any]:
        ran = run_example_sequence("lightning_module.py", w / "ex")
        last = Path(ran["outs"][-1]) / "checkpoints" / "last.ckpt"
        ran["final_step"] = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
        return ran

    scenarios["example"] = example
    def readme(w: Path) -> dict[str, Any]:
        """The README's Lightning recipe as a reader runs it: twice in the same directory. What each run read
        of the data, the checkpoint it started from, where it stopped."""
        loader = readme_loader()
        names = {"build_model": readme_model, "loader": loader}
        probe = lambda ns: {
            "reads": loader.dataset.reads,
            "samples": len(loader.dataset),
            "ckpt_path": ns["trainer"].ckpt_path,
            "global_step": ns["trainer"].global_step,
        }
        return run_readme("lightning", names, w / "readme", probe)

    scenarios["readme"] = readme
    scenarios["readme-again"] = readme  # the second run, after the first (scenarios run in order)
    return scenarios


# -- the guards of tests/test_framework_guards.py -----------------------------------------------------

CLIP = 0.05  # the Lightning guards' gradient_clip_val (below the tiny LM's gradient norm)


def hf_guard_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Saves requested by a user's callback, torch_compile, ``optim=``, ``save_only_model`` (2 ranks)."""
    from transformers import TrainerCallback

    kit = hf_kit()

    class SaveAfterEval(TrainerCallback):
        """A user's "checkpoint after every evaluation"."""

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_save = True

    class SaveAt(TrainerCallback):
        """A user's save at step SAVE_AT, added after the Trainer was built (it runs after lioncub's)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_save = control.should_save or state.global_step == SAVE_AT

    runs: dict[str, Callable[[], dict[str, Any]]] = {
        # a Trainer subclass + LionCubCallback, 8bit; saved only where the user's callback says
        "eval-save": lambda: dict(
            variant="8bit",
            callback=True,
            late=(SaveAfterEval(),),
            evaluate=True,
            eval_strategy="steps",
            eval_steps=SAVE_AT,
            save_strategy="no",
        ),
        "late-save": lambda: dict(variant="1bit", callback=False, late=(SaveAt(),), save_strategy="no"),
        "only-model": lambda: dict(variant="1bit", callback=False, save_only_model=True),
    }
    scenarios: dict[str, Callable[[Path], dict[str, Any]]] = {}
    for name, kw in runs.items():
        scenarios[name] = lambda w, n=name, kw=kw: kit.train(w / n, overlap=False, **kw())
        scenarios[f"{name}-resume"] = lambda w, n=name, kw=kw: kit.train(
            w / n, overlap=False, resume=True, **{**kw(), "output_dir": str(w / f"{n}-resume")}
        )
    class TinyTrained(nn.Module):
        """:class:`TinyLM` as the Trainer calls a model: ``forward(input_ids, labels)`` -> ``{"loss": ...}``
        (for ``compile``: dynamo traced GPT-2 through DDP in ~3.5 CPU-s per rank, and what it checks holds
        for any model)."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_lm()

        def forward(self, input_ids: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
            return {"loss": lm_loss(self.lm, input_ids)}  # labels: the same tokens, shifted in lm_loss

    scenarios["compile"] = lambda w: kit.train(
        w / "compile",
        "1bit",
        False,
        callback=False,
        save_strategy="no",
        torch_compile=True,
        torch_compile_backend="eager",
        build=TinyTrained,
    )

    def optim_arg(w: Path) -> dict[str, Any]:
        warned = {}
        for optim in ("adafactor", None):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                args = kit.args(w / "optim", **({"optim": optim} if optim else {}))
                kit.LionCubTrainer(model=kit.model(), args=args, train_dataset=kit.data)
            warned[str(optim)] = [str(c.message) for c in caught if "TrainingArguments(" in str(c.message)]
        return warned

    scenarios["optim-arg"] = optim_arg
    # local steps with max_steps and eval_steps that are not multiples of H: the Trainer warns of the first
    # and evaluates θ of the last outer step in a window's middle
    scenarios["local-odd"] = lambda w: kit.train(
        w / "local-odd",
        "1bit",
        False,
        callback=False,
        lioncub={"local_steps": LOCAL_H},
        max_steps=SAVE_AT,
        evaluate=True,
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        save_strategy="no",
    )
    return scenarios


def hf_resize_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Resume hf-guards' 2-rank ``late-save`` checkpoint on this job's ranks (3): refused, then allowed."""
    kit = hf_kit()

    def resume(w: Path, name: str, **options: Any) -> dict[str, Any]:
        return kit.train(
            w / "late-save",
            "1bit",
            False,
            callback=False,
            resume=True,
            lioncub=options,
            save_strategy="no",
            output_dir=str(w / name),
        )

    return {
        "resize-refused": lambda w: {"message": expect_error(lambda: resume(w, "resize-refused"))},
        "resize": lambda w: resume(w, "resize", allow_world_size_change=True),
    }


def accelerate_guard_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    return {"compile": lambda w: accelerate_train(w / "compile", "1bit", False, dynamo_backend="eager")}


def lightning_guard_scenarios() -> dict[str, Callable[[Path], dict[str, Any]]]:
    """gradient_clip_val under bf16-mixed (no scaler) and 16-mixed (a GradScaler; Lightning would make
    16-mixed on CPU bf16-mixed, so the plugin is given)."""
    from lightning.pytorch.plugins import MixedPrecision

    kit = lightning_kit()
    return {
        # local steps, H = 2, validated after every step and checkpointed at step 3 (a window's middle)
        "local-val": lambda w: kit.train(
            w / "local-val",
            "1bit",
            False,
            local_steps=LOCAL,
            validate=True,
            val_check_interval=1,
            check_val_every_n_epoch=None,
            limit_val_batches=1,
        ),
        "bf16-clip": lambda w: kit.train(w / "bf16", "1bit", False, clip=CLIP, precision="bf16-mixed"),
        "16-clip": lambda w: kit.train(
            w / "16", "8bit", False, clip=CLIP, plugins=[MixedPrecision("16-mixed", "cpu")]
        ),
    }


def run_example(name: str, argv: list[str]) -> dict[str, Any]:
    """Run ``examples/<name>`` as ``__main__`` with ``argv``; what it printed is not captured."""
    saved = sys.argv
    sys.argv = [name, *argv]
    try:
        runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    finally:
        sys.argv = saved
    return {"ran": name}


def example_commands(name: str) -> list[list[str]]:
    """The options (what follows ``examples/<name>``) of each command in the example's docstring, in order."""
    doc = ast.get_docstring(ast.parse((REPO / "examples" / name).read_text())) or ""
    commands = []
    for line in doc.splitlines():
        if f" examples/{name}" in line:
            words = shlex.split(line, comments=True)
            commands.append(words[words.index(f"examples/{name}") + 1 :])
    return commands


#: the example sequences' shrunk lengths: the first runs (and the variant beside them) 2 steps, the resumed
#: run continues to 4
EXAMPLE_STEPS, RESUMED_STEPS = 2, 4


def shrunk_example_commands(name: str, workdir: Path) -> list[list[str]]:
    """The commands of ``examples/<name>``'s docstring, shrunk: ``--steps`` EXAMPLE_STEPS (RESUMED_STEPS
    with ``--resume``), every ``--out`` under ``workdir``."""
    commands = []
    for argv in example_commands(name):
        steps = str(RESUMED_STEPS if "--resume" in argv else EXAMPLE_STEPS)
        if "--steps" in argv:
            argv[argv.index("--steps") + 1] = steps
        else:
            argv += ["--steps", steps]
        out = argv.index("--out") + 1
        argv[out] = str(workdir / argv[out])
        commands.append(argv)
    return commands


def run_example_sequence(name: str, workdir: Path) -> dict[str, Any]:
    """:func:`shrunk_example_commands` run in order in this job's ranks; the outs each named, in order."""
    commands = shrunk_example_commands(name, workdir)
    for argv in commands:
        run_example(name, argv)
    return {"ran": name, "outs": [argv[argv.index("--out") + 1] for argv in commands]}


SCENARIOS = {
    "hf": hf_scenarios,
    "accelerate": accelerate_scenarios,
    "lightning": lightning_scenarios,
    "hf-guards": hf_guard_scenarios,
    "hf-resize": hf_resize_scenarios,
    "accelerate-guards": accelerate_guard_scenarios,
    "accelerate-example": accelerate_example_scenarios,
    "lightning-guards": lightning_guard_scenarios,
}


#: every job of a framework, in order, one sequence for both test modules: tests/test_integrations.py's
#: scenarios, then tests/test_framework_guards.py's, in the same launch where that changes nothing they
#: check (``NAME+NAME``: one launch fewer), and every framework's sequence in one runner (below)
SEQUENCES = {
    "hf": [("hf+hf-guards", 2), ("hf-resize", 3)],
    "lightning": [("lightning+lightning-guards", 2)],
    "accelerate": [
        ("accelerate", 2),
        ("accelerate-guards", 2),  # its own: Accelerator(dynamo_backend=...) after an earlier Accelerator in
        # the process takes that one's state (AcceleratorState is process-wide) and compiles nothing
        *((f"accelerate-example/{name}", 2) for name in ("example-1", "example-2", "example")),
    ],
}
#: what each framework's jobs import
NEEDS = {"hf": ["transformers", "accelerate"], "accelerate": ["accelerate"], "lightning": ["lightning"]}
#: the bound (s) of the one job that runs every framework's sequence, and of each launch in it
JOB_TIMEOUT, LAUNCH_TIMEOUT = 900, 240
#: both test modules' one background job (tests/background.py): every installed framework's sequence
KEY = "frameworks"


def missing(framework: str) -> list[str]:
    """What ``framework``'s jobs need that is not installed."""
    import importlib.util

    return [m for m in NEEDS[framework] if importlib.util.find_spec(m) is None]


def frameworks_job() -> Any:
    """The background job of every installed framework's sequence, one after the other in one runner
    (:func:`run_job`); None where no framework is installed."""
    import background

    installed = [f for f in SEQUENCES if not missing(f)]
    if not installed:
        return None
    return background.Spawned(run_job, 1, (LAUNCH_TIMEOUT, *installed), timeout=JOB_TIMEOUT)


def run_job(rank: int, world: int, workdir: Path, timeout: int, *frameworks: str) -> None:
    """The background job's runner: :func:`run_sequences` into ``workdir/out``, what it and the ranks print
    in ``workdir/output``; a fork of the worker pool's fork server (``background.Spawned``: torch already
    imported, where an interpreter of its own imported it again, ~2.5 CPU-s)."""
    with open(workdir / "output", "w") as output:
        try:
            run_sequences(str(workdir / "out"), str(timeout), *frameworks, output=output)
        except BaseException:
            traceback.print_exc(file=output)
            raise


BACKGROUND = {KEY: frameworks_job}


#: what dynamo imports at its first trace (the ``compile`` scenarios of the Trainer and of accelerate): its
#: context-parallel attention (with networkx, inductor's and functorch's modules) and the eager backend's
#: module, ~0.45 CPU-s in each compiling rank (~0.1 left to them)
COMPILE_MODULES = ("torch.distributed.tensor.experimental", "torch._dynamo.backends.debugging")
#: what a framework's ranks import besides torch: the framework, lioncub's integration with it, what its
#: scenarios load lazily (GPT-2's module for the Trainer's runs; dynamo's for ``compile``)
FRAMEWORK_MODULES = {
    "hf": (
        "transformers", "transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "accelerate",
        "lioncub.integrations.hf", *COMPILE_MODULES,
    ),
    "accelerate": ("accelerate", "lioncub.integrations.accelerate", *COMPILE_MODULES),
    "lightning": ("lightning.pytorch", "lioncub.integrations.lightning"),
}  # fmt: skip
#: what every framework's ranks import: lioncub, its optimizer (``import lioncub`` alone loads it lazily,
#: ~0.05 CPU-s in every rank) and the data module of the examples and the README's blocks
COMMON_MODULES = ("lioncub", "lioncub.optim.lioncub", "lioncub.train.data")


def preloaded(frameworks: tuple[str, ...]) -> tuple[str, ...]:
    """What the one zygote of every launch imports when ``frameworks`` run: what each of them imports
    (:data:`FRAMEWORK_MODULES`) besides torch (``lioncub.launch.preload.MODULES``) and lioncub. One zygote
    importing every framework costs ~7.5 CPU-s; a second one for accelerate's launches imported torch,
    lioncub and accelerate again (~3.2 CPU-s)."""
    from lioncub.launch.preload import MODULES

    ours = (m for f in frameworks for m in FRAMEWORK_MODULES[f])
    return tuple(dict.fromkeys([*MODULES, *COMMON_MODULES, *ours]))


def run_sequences(out: str, timeout: str, *frameworks: str, output: TextIO | None = None) -> int:
    """``--sequences``: each framework's :data:`SEQUENCES` in turn, ``lioncub launch --nproc K -- -m
    framework_jobs NAME OUT/FRAMEWORK`` for each ``(NAME, K)`` (``NAME+NAME``: those scenario sets in one
    launch; ``... NAME OUT/FRAMEWORK SCENARIO`` for ``NAME/SCENARIO``: that scenario alone; a later job may
    start from an earlier one's checkpoints), every launch's ranks forked from one interpreter that
    imported torch, lioncub and every framework that runs once (``lioncub launch --preload``,
    :func:`preloaded`; a fresh interpreter per rank would import them again for every rank of every job),
    and one runner for all (a runner per framework imported torch once more each).
    The accelerate example's launches end through the interpreter's teardown (:data:`TEARDOWN`). A rank of
    one used to hang at its end (3 times in ~240 launches here): the DDP model's reducer freed the process
    group last, and torch joined the group's gloo threads with the GIL held while one of them needed it to
    drop a finished collective's tensors (py-spy). The example now frees its model before
    ``end_training`` (0 hangs in 250 launches of its ``--variant 8bit --overlap`` command, 3 in 110 before);
    the 240 s launch timeout still bounds a launch.
    Writes each framework's launches' exit codes to ``OUT/FRAMEWORK.codes.json``
    (:func:`sequence_results`), what they print to ``output`` (default stdout); fails if any launch
    failed."""
    from lioncub.launch import LaunchConfig, launch

    output = output or sys.stdout
    failed, preload = 0, preloaded(frameworks)
    for framework in frameworks:
        print(f"== framework {framework}", file=output, flush=True)
        codes = {}
        for spec, nproc in SEQUENCES[framework]:
            name, *only = spec.split("/")  # NAME or NAME/SCENARIO (that scenario alone)
            config = LaunchConfig(
                ["-m", "framework_jobs", name, str(Path(out) / framework), *only], nproc=nproc,
                timeout_s=float(timeout), cwd=str(Path(__file__).parent), preload=preload,
            )  # fmt: skip
            codes[f"{spec}:{nproc}"] = code = launch(config, out=output, err=output).returncode
            print(f"job {spec}:{nproc}: exit code {code}", file=output, flush=True)
            failed = failed or code
        (Path(out) / f"{framework}.codes.json").write_text(json.dumps(codes))
    return failed


def sequence_results(framework: str) -> dict[str, list[dict[str, Any]]]:
    """For the tests: what ``framework``'s sequence saw, scenario -> each rank's result (waits for the
    job); fails with that framework's part of the job's output if any of its launches failed."""
    import background

    exits = background.result(KEY, BACKGROUND[KEY])
    out = background.workdir(KEY) / "out"
    codes = out / f"{framework}.codes.json"
    if not codes.exists() or any(json.loads(codes.read_text()).values()):
        printed = (background.workdir(KEY) / "output").read_text(errors="replace")
        part = printed.partition(f"== framework {framework}\n")[2] or printed
        raise AssertionError(
            f"{framework}: launches {codes.read_text() if codes.exists() else 'not all run'} (the "
            f"runner's exit code {exits[0]})\n{part[:6000]}"
        )
    return load_results(out / framework)


def load_results(out: Path) -> dict[str, list[dict[str, Any]]]:
    """scenario -> what each rank saw (rank order); every rank's entry is ``{"error": ...}`` if one failed."""
    loaded: dict[str, list[dict[str, Any]]] = {}
    for name in sorted({p.name.rsplit(".rank", 1)[0] for p in out.glob("*.rank*.pt")}):
        paths = sorted(out.glob(f"{name}.rank*.pt"), key=lambda p: int(p.name.rsplit("rank", 1)[1][:-3]))
        ranks = [torch.load(p, weights_only=False) for p in paths]
        errors = [r["error"] for r in ranks if "error" in r]
        loaded[name] = [{"error": "\n".join(errors)}] * len(ranks) if errors else [r["ok"] for r in ranks]
    return loaded


#: scenario sets whose ranks end as a user's process does, through the interpreter's teardown: the
#: accelerate example's commands, one per launch as a user runs them. The other ranks' results are written
#: (``torch.save`` closed each file) when they end, and they end as lioncub's training ranks do, without the
#: teardown (:func:`lioncub.launch.preload.end_rank`: ~0.3 CPU-s a rank forked from a zygote)
TEARDOWN = {"accelerate-example"}


def main() -> None:
    if sys.argv[1] == "--sequences":
        sys.exit(run_sequences(*sys.argv[2:]))
    names, out, *only = sys.argv[1:]
    torch.set_num_threads(1)
    scenarios: dict[str, Callable[[Path], dict[str, Any]]] = {}
    for name in names.split("+"):  # NAME or NAME+NAME...: those sets, in order, in this one launch
        more = SCENARIOS[name]()
        assert not scenarios.keys() & more.keys(), f"{names}: scenarios named alike"
        scenarios |= more
    with contextlib.ExitStack():
        run_scenarios(scenarios, Path(out), only)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
    if sys.argv[1] != "--sequences" and not set(sys.argv[1].split("+")) & TEARDOWN:
        end_rank(0)
