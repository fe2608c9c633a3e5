import os
import tempfile

import pytest
import torch

# A cache private to this test session: token files and measured peaks are made fresh once,
# never read from a developer's ~/.cache.
_CACHE = tempfile.mkdtemp(prefix="onegpu-test-cache-")
os.environ["ONEGPU_CACHE"] = _CACHE


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is (`pytest -m gpu` on a GPU machine): on a CPU
    they are deselected, never skipped into the count of what ran."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(autouse=True, scope="session")
def _small_matmul_peaks():
    """MFU's denominator is measured once per machine (a 4096^3 matmul per dtype: ~15 s on a
    slow core). No test checks MFU's value, so the session measures it at 512^3: real figures,
    a second instead of a minute."""
    from unittest import mock

    from onegpu.perf import contention
    from onegpu.perf.devices import cpu_peak_flops

    # kept however busy the machine is: a subprocess test would otherwise time 4096^3; at the
    # test process's threads and at 1, a launched run's (OMP_NUM_THREADS=1) and a plan's for it
    threads = torch.get_num_threads()
    with mock.patch.object(contention, "MAX_WAIT_SHARE", float("inf")):
        for n in dict.fromkeys((threads, 1)):
            torch.set_num_threads(n)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                cpu_peak_flops(dtype, n=512)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _timings_kept_however_busy(request, monkeypatch):
    """In the test process a kernel timing is kept however busy the CPUs are: a machine that
    loses a core mid-test would otherwise add a warning line to an error a test asserts is one
    line. The judgement itself is tested in tests/perf/test_contention.py (against a real busy
    process) and where a test sets it (RunQueueWatch.disturbed); subprocess runs judge as a
    user's run does."""
    if request.module.__name__.rpartition(".")[2] != "test_contention":
        from onegpu.perf import contention

        monkeypatch.setattr(contention, "MAX_WAIT_SHARE", float("inf"))


@pytest.fixture(autouse=True)
def _kernel_trials_not_compiled(request, monkeypatch):
    """A run's `auto` compiles kernels to time them (attention for a compiling run, the GELU
    kernel): seconds of inductor each, in every fast test that builds a long run. There the
    attention candidates are timed as they run eagerly and the GELU kernel's compile is
    recorded as failed (ATen's kept); the tests of those choices stub the timing themselves,
    and the slow suite times them for real (tests/techniques/test_attention.py,
    test_gelu_kernel.py)."""
    if request.node.get_closest_marker("slow"):
        return
    from onegpu.techniques import attention, gelu_kernel

    monkeypatch.setattr(attention, "_as_compiled", lambda name: attention._KERNELS[name])
    monkeypatch.setattr(
        gelu_kernel, "measure_gelu_kernel", lambda *a: {"failed": "not compiled in fast tests"}
    )


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left_open():
    """A process group a test leaves open stops every later test that opens one (the planner's
    fake group too): the test that left it fails, not the next."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group open")


@pytest.fixture
def tiny_cfg():
    from onegpu.config import load_config

    return load_config("tiny", overrides={"train.device": "cpu", "out.progress": "false"})


def accumulate(model, x, y, n_micro: int):
    """One batch's loss, its gradients left in `.grad`, accumulated over `n_micro`
    micro-batches by the production step (fp32 policy, no update)."""
    from onegpu.backends.torch.loader import count_targets
    from onegpu.backends.torch.step import TrainStep
    from onegpu.config import OptimConfig
    from onegpu.techniques.loss import token_loss_sum
    from onegpu.techniques.precision import resolve_precision

    model.zero_grad(set_to_none=True)
    cpu = torch.device("cpu")
    step = TrainStep(
        model=model,
        loss_fn=token_loss_sum,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        policy=resolve_precision("fp32", cpu),
        device=cpu,
        optim=OptimConfig(),
        max_steps=1,
        n_micro=n_micro,
    )
    return step.forward_backward(x, y, count_targets(y))


# ---------------------------------------------------------------------------- Hugging Face folders

HF_ARCHS = ("llama", "qwen2", "gpt2", "mistral", "phi")


def hf_overrides(folder, seq_len: int = 32, **over) -> dict[str, str]:
    """Command-line overrides of a small exact CPU run of a model folder (fp32, batch 8)."""
    base = {
        "model.hf": str(folder),
        "model.seq_len": str(seq_len),
        "train.device": "cpu",
        "train.precision": "fp32",
        "train.batch_size": "8",
        "train.micro_batch_size": "8",
        "out.progress": "false",
    }
    return base | {k: str(v) for k, v in over.items()}


def make_hf_config(arch: str, vocab: int = 320, layers: int = 2):
    """A tiny configuration of a transformers architecture (no dropout: exact comparisons)."""
    import transformers

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        vocab_size=vocab,
        max_position_embeddings=128,
    )
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=64, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if arch == "phi":
        return transformers.PhiConfig(**common, resid_pdrop=0.0, embd_pdrop=0.0)
    if arch == "bert":
        return transformers.BertConfig(
            hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=128, vocab_size=vocab, max_position_embeddings=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
            architectures=["BertForSequenceClassification"],
        )  # fmt: skip
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    return cls(**common, num_key_value_heads=2)


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(arch, weights=True): a saved tiny model folder (config.json + safetensors),
    made once per session."""
    import transformers

    made: dict = {}

    def make(arch: str, weights: bool = True):
        key = (arch, weights)
        if key not in made:
            path = tmp_path_factory.mktemp(f"hf-{arch}-{'w' if weights else 'cfg'}")
            cfg = make_hf_config(arch)
            if weights:
                torch.manual_seed(1)
                auto = (
                    transformers.AutoModelForSequenceClassification
                    if arch == "bert"
                    else transformers.AutoModelForCausalLM
                )
                auto.from_config(cfg).save_pretrained(path)
            else:
                cfg.save_pretrained(path)
            made[key] = path
        return made[key]

    return make
