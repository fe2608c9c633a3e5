"""Several processes equal one: `torchrun` with the gloo backend, two processes on this CPU.

Every test launches `python -m torch.distributed.run --standalone --nproc-per-node N -m onegpu
train` exactly as a user would, on the `tiny` preset (fp32, no dropout). Tolerances: the
processes' gradients are summed in another order than one process sums its micro-batches
(reduction order), so losses agree to float32 rounding, 1e-5 relative, not bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from launching import BASE, REL, STEPS, _args, _env, assert_same_losses, launch, losses

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.config import load_config
from onegpu.plan.report import plan_report
from onegpu.runs import checkpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference runs, each launched once for the module: one process with 4
    micro-batches, DDP over 2 x 1 micro-batch (checkpoints written in the background), FSDP
    over 2 x 2 micro-batches (checkpoints written during the step)."""
    root = tmp_path_factory.mktemp("dist")
    made = {
        "single": (root / "single", 1, {"train.micro_batch_size": 2}),
        "ddp": (
            root / "ddp",
            2,
            {"train.micro_batch_size": 4, "dist.strategy": "ddp", "checkpoint.async_save": "on"},
        ),  # fmt: skip
        "fsdp": (root / "fsdp", 2, {"train.micro_batch_size": 2, "dist.strategy": "fsdp"}),
    }
    for out, nproc, over in made.values():
        launch(out, nproc, **over)
    return {name: out for name, (out, _, _) in made.items()}


def test_ddp_and_fsdp_losses_equal_one_process(runs):
    single = losses(runs["single"])
    assert len(single) == STEPS and single[STEPS] < single[1]
    assert_same_losses(losses(runs["ddp"]), single)
    # 2 processes x 2 micro-batches of 2 = 1 process x 4 micro-batches of 2 (token-exact)
    assert_same_losses(losses(runs["fsdp"]), single)


def test_rank_zero_writes_the_run_folder_and_every_rank_is_measured(runs):
    summary = json.loads((runs["fsdp"] / "summary.json").read_text())
    d = summary["dist"]
    assert d["strategy"] == "fsdp" and d["world_size"] == 2 and d["backend"] == "gloo"
    assert [r["rank"] for r in d["per_rank"]] == [0, 1]
    assert all(r["peak_mem_bytes"] > 0 for r in d["per_rank"])
    assert summary["peak_flops_source"].endswith("x 2")  # MFU over both devices
    from safetensors.torch import load_file

    # gathered from the shards: the same whole tensors as one process's, equal to rounding
    whole = load_file(runs["fsdp"] / "model.safetensors")
    single = load_file(runs["single"] / "model.safetensors")
    assert whole.keys() == single.keys()
    for name, t in single.items():
        torch.testing.assert_close(whole[name], t, rtol=1e-4, atol=1e-6)


def test_auto_precision_is_decided_once_for_every_process(tmp_path):
    """`auto` precision on a CPU weighs the matmul peaks (cached per machine, measured by
    whichever process gets there first): rank 0 decides and every process runs its choice."""
    launch(tmp_path, 2, **{"dist.strategy": "ddp", "train.precision": "auto"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    chosen = load_config(file=tmp_path / "config.toml").train.precision
    assert summary["precision"] == chosen
    if weighed := summary["precision_auto"]:  # a CPU with native bf16
        pays = weighed["bf16_speedup"] >= weighed["margin"]
        assert chosen == ("bf16" if pays else "fp32")
    else:
        assert chosen == "fp32"
    assert len(losses(tmp_path)) == STEPS


def test_fsdp_shards_parameters_and_states_and_the_plan_predicts_them(runs):
    """Per process: parameter + optimizer bytes about 1/2 of one process's (measured), and
    `onegpu plan --world-size 2` within 5% of the measurement."""
    from onegpu.backends.torch.build import build

    cfg = load_config("tiny", overrides={k: str(v) for k, v in BASE.items()})
    built = build(cfg, with_data=False)
    x = torch.randint(0, 256, (8, 64))
    built.step(x, x, x.numel(), 0)  # optimizer states exist after a step
    from onegpu.optim.state_bytes import optimizer_state_bytes

    single = sum(p.numel() * p.element_size() for p in built.model.parameters())
    single += optimizer_state_bytes(built.optimizer)
    per_rank = json.loads((runs["fsdp"] / "summary.json").read_text())["dist"]["per_rank"]
    for r in per_rank:
        measured = r["param_bytes"] + r["optimizer_bytes"]
        assert measured == pytest.approx(single / 2, rel=0.02)
    plan_cfg = load_config(
        "tiny",
        overrides={**{k: str(v) for k, v in BASE.items()}, "train.micro_batch_size": "2"},
    )
    planned = plan_report(plan_cfg, None, None, world_size=2)["memory"]
    rank0 = per_rank[0]["param_bytes"] + per_rank[0]["optimizer_bytes"]
    assert planned["params"] + planned["optimizer"] == pytest.approx(rank0, rel=0.05)


def test_two_rank_checkpoint_resumes_on_one_process(runs, tmp_path):
    folder = runs["fsdp"] / "checkpoints" / ckpt.checkpoint_name(2, sharded=True)
    assert (folder / ".metadata").is_file() and (folder / ckpt.TRAIN_STATE).is_file()
    launch(tmp_path / "one", 1, **{"train.micro_batch_size": 2, "train.resume": str(folder)})
    resumed = losses(tmp_path / "one")
    assert sorted(resumed) == [3, 4]
    assert_same_losses(resumed, {s: v for s, v in losses(runs["fsdp"]).items() if s > 2})


def test_a_background_checkpoint_is_whole_and_resumes_exactly(runs, tmp_path):
    """DDP's run saved at steps 2 and 4 with checkpoint.async_save on: the shards of step 2
    were staged during step 2's save and written while step 3 ran; the checkpoint holds step
    2's state, not a later one's."""
    folders = [p for _, p in checkpoints.complete_checkpoints(runs["ddp"] / "checkpoints")]
    assert [p.name for p in folders] == [ckpt.checkpoint_name(s, sharded=True) for s in (2, 4)]
    assert not list((runs["ddp"] / "checkpoints").glob(f"{checkpoints.TMP_PREFIX}*"))
    launch(tmp_path / "again", 2, **{"train.micro_batch_size": 4, "dist.strategy": "ddp",
                                     "train.resume": str(folders[0])})  # fmt: skip
    resumed = losses(tmp_path / "again")
    assert sorted(resumed) == [3, 4]
    assert_same_losses(resumed, {s: v for s, v in losses(runs["ddp"]).items() if s > 2})


def test_a_sharded_checkpoint_exports_the_final_weights(runs, tmp_path):
    """Without model.safetensors, `onegpu export` reads the newest sharded checkpoint (DCP,
    no process group): its weights equal the gathered final weights rank 0 wrote."""
    import shutil

    from onegpu.cli import main
    from onegpu.tools.trained import load_trained

    run = tmp_path / "run"
    shutil.copytree(runs["fsdp"], run)
    (run / "model.safetensors").unlink()
    from_checkpoint = load_trained(run)
    assert from_checkpoint.weights.endswith(ckpt.checkpoint_name(STEPS, sharded=True))
    final = load_trained(runs["fsdp"]).model.state_dict()
    for name, tensor in from_checkpoint.model.state_dict().items():
        assert torch.equal(tensor, final[name]), name
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0  # checks its logits
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_one_process_checkpoint_resumes_on_two(runs, tmp_path):
    file = runs["single"] / "checkpoints" / ckpt.checkpoint_name(2)
    launch(tmp_path / "two", 2, **{"train.micro_batch_size": 2, "dist.strategy": "fsdp",
                                   "train.resume": str(file)})  # fmt: skip
    resumed = losses(tmp_path / "two")
    assert sorted(resumed) == [3, 4]
    assert_same_losses(resumed, {s: v for s, v in losses(runs["single"]).items() if s > 2})


def test_cpu_offload_trains_with_parameters_on_the_host(runs, tmp_path):
    launch(tmp_path / "off", 2, **{"train.micro_batch_size": 2, "dist.cpu_offload": "true"})
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert summary["dist"]["cpu_offload"] is True
    assert {r["param_device"] for r in summary["dist"]["per_rank"]} == {"cpu"}
    # offloading moves bytes, never numbers
    assert_same_losses(losses(tmp_path / "off"), losses(runs["single"]))


def test_fsdp_keeping_gathered_parameters_to_backward_changes_no_number(runs, tmp_path):
    launch(tmp_path / "zero2", 2, **{"train.micro_batch_size": 2, "dist.strategy": "fsdp",
                                     "dist.reshard_after_forward": "false"})  # fmt: skip
    summary = json.loads((tmp_path / "zero2" / "summary.json").read_text())
    assert summary["dist"]["reshard_after_forward"] is False
    assert_same_losses(losses(tmp_path / "zero2"), losses(runs["single"]))


def test_a_kill_during_sharded_saves_leaves_the_previous_checkpoint_usable(tmp_path):
    """SIGKILL the whole job (launcher and workers) while it saves a sharded checkpoint every
    step in the background, wherever it is then (often inside a save or with one in flight);
    every checkpoint under a final name is whole, the newest resumes, and the run ends with
    the uninterrupted run's losses."""
    out, steps = tmp_path / "killed", 12
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", "onegpu", "train"]  # fmt: skip
    over = {"train.micro_batch_size": 2, "checkpoint.every": 1, "train.max_steps": steps,
            "checkpoint.async_save": "on"}  # fmt: skip
    proc = subprocess.Popen(
        cmd + _args(out, over),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    folder = out / "checkpoints"
    while time.monotonic() < deadline and len(checkpoints.complete_checkpoints(folder)) < 3:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = checkpoints.complete_checkpoints(folder)
    assert saved and saved[-1][0] < steps, "the run ended before it was killed"
    for _, path in saved:  # every folder under a checkpoint's name is whole
        assert (path / ".metadata").is_file() and (path / ckpt.TRAIN_STATE).is_file()
    launch(out, 2, **over, **{"train.resume": "auto"})
    assert not list(
        folder.glob(f"{checkpoints.TMP_PREFIX}*")
    )  # the killed save's leftovers are gone
    launch(tmp_path / "whole", 2, **over)
    assert_same_losses(losses(out), losses(tmp_path / "whole"))


def test_bad_input_under_torchrun_is_one_line_and_exit_2(tmp_path):
    proc = launch(tmp_path / "bad", 2, check=False, **{"train.batch_size": 6,
                                                       "train.micro_batch_size": 2})  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("onegpu: error:")]
    assert len(errors) == 1 and "train.batch_size" in errors[0]


def test_a_killed_worker_is_restarted_by_torchrun_and_ends_on_the_same_losses(tmp_path):
    """`torchrun --max-restarts 1 ... --train.resume auto`: a worker killed with SIGKILL after
    the first checkpoint; the restarted attempt (its own store prefix: no stale gloo address of
    the dead one) resumes and ends on the uninterrupted run's losses."""
    steps = 60
    over = {"train.max_steps": steps, "checkpoint.every": 10, "train.micro_batch_size": 4,
            "dist.strategy": "ddp", "train.resume": "auto"}  # fmt: skip
    straight = tmp_path / "straight"
    launch(straight, 2, **over)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "-m", "onegpu", "train", *_args(out, over)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), start_new_session=True)  # fmt: skip
    deadline = time.time() + 120
    while not checkpoints.complete_checkpoints(out / "checkpoints") and time.time() < deadline:
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-f", f"onegpu train .*{out}"], capture_output=True,
                             text=True).stdout.split()  # fmt: skip
    worker = max(int(pid) for pid in workers if int(pid) != proc.pid)
    os.kill(worker, signal.SIGKILL)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert "exitcode: -9" in log and "connectFullMesh" not in log  # killed, then restarted
    final = losses(out)
    assert max(final) == steps
    assert final[steps] == pytest.approx(losses(straight)[steps], rel=REL)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_packed_rows_split_over_processes_equal_one_process(tmp_path, strategy):
    """Each process takes its rows of a packed batch with their positions: the same losses."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "data"))
    from instruction_sets import arithmetic_rows, write_jsonl

    source = write_jsonl(tmp_path / "pr.jsonl", arithmetic_rows(300))
    data = {"data.source": str(source), "data.packing": "bfd", "model.seq_len": "128"}
    launch(tmp_path / "one", 1, **data, **{"train.micro_batch_size": 2})
    launch(tmp_path / "two", 2, **data, **{"train.micro_batch_size": 2, "dist.strategy": strategy})
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["data"]["rows"] < summary["data"]["examples"]  # packed: several a row
    assert_same_losses(losses(tmp_path / "two"), losses(tmp_path / "one"))
