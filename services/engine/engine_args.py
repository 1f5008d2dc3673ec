"""Engine settings, shared by `kvrelay generate`, `serve`, `prefill` and `decode`."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from kvrelay.models import BUNDLED_MODEL

CPU_KV_MEMORY_SHARE = 0.1  # on CPU, at most this share of the memory available at start-up goes to the KV cache
CPU_KV_RULE = (
    "on CPU: what --max-num-seqs sequences of --max-model-len tokens need, at most "
    f"{CPU_KV_MEMORY_SHARE:.0%} of the memory available at start-up, and at least one such sequence"
)
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2g', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_kv_cache_blocks(bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int,
                        available: int | None = None) -> int:
    """The CPU KV cache's block count when --kv-cache-memory is not given (CPU_KV_RULE)."""
    per_seq = -(-max_model_len // block_size)
    share = int((available if available is not None else available_memory_bytes()) * CPU_KV_MEMORY_SHARE)
    return max(per_seq, min(per_seq * max_num_seqs, share // bytes_per_block))


@dataclass
class EngineArgs:
    model: str = str(BUNDLED_MODEL)
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()  # more names the gateway accepts (--served-model-name A B C)
    dtype: str = "auto"  # auto: the config's torch_dtype (float32 for the bundled model)
    load_format: str = "auto"  # auto | dummy (random weights from config.json alone)
    quantization: str | None = None  # None | "int8" (W8A16, per output channel) | "fp8" (W8A8: per channel, per token)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the paged KV pool; None: see kv_cache_bytes_default
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9  # CUDA, without kv_cache_memory: share of the device to use
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    # Detokenize a step's tokens during the next step's forward; None: on CUDA only (in one process
    # on CPU the forward is synchronous, and CPU worker processes take every core).
    async_output: bool | None = None
    # Launch step N+1 before reading step N's tokens (kvrelay.engine.async_scheduling): hides the
    # host's work per step behind the GPU's. Off by default until the device benchmark shows it.
    async_scheduling: bool = False
    # CUDA: steps with prefill replay graphs of everything between attentions, per token bucket
    # (kvrelay.engine.runner.piecewise_graphs). Off by default until the device benchmark shows it.
    piecewise_cuda_graphs: bool = False
    speculative_method: str | None = None  # None | "ngram" | "draft"
    speculative_model: str | None = None  # the draft model's folder (method "draft")
    num_speculative_tokens: int = 4  # K: proposed tokens per sequence and step
    ngram_min: int = 2  # a single-token match proposes mostly noise
    ngram_max: int = 4
    speculative_disable_batch_size: int = 32  # no speculation in steps with more running sequences
    speculative_adaptive: bool = True  # measure, per batch size, whether speculating is faster
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enable_prefix_caching: bool = True
    kernel_backend: str = "auto"  # auto | torch | native | triton
    device: str = "auto"  # auto | cpu | cuda
    cpu_threads: int | None = None  # CPU engines: torch threads; None: cpu_threads.plan_threads decides
    # Not a flag: CPUs kept for processes beside this engine (serve keeps one for its API process).
    reserved_cpus: int = 0
    dummy_seed: int = 0  # random weights of --load-format dummy
    tensor_parallel_size: int = 1  # worker processes splitting each layer (kvrelay.engine.parallel)
    pipeline_parallel_size: int = 1  # worker processes holding contiguous layer stages
    # PP > 1: as many steps in flight as stages, so the stages overlap. None: on CUDA only (on a few
    # shared CPU cores the stages have no cores of their own to overlap on; docs/benchmarks.md).
    pipeline_overlap: bool | None = None
    enable_expert_parallel: bool = False  # MoE: the tensor-parallel ranks hold disjoint experts
    # vLLM's name: "mp" runs the model in worker processes (forced even at world size 1, which is
    # how one GPU checks the parallel path), "uni" in this process; None: mp when tp×pp > 1.
    distributed_executor_backend: str | None = None
    # Ranks on several nodes (parallel/multinode.py): this engine is node 0 of nnodes; the others run
    # `kvrelay parallel-worker`. dist_init_addr: HOST:PORT, the rendezvous (control at PORT+1).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    plugins: str | None = None  # "a,b": load only these plugins (default: $KVRELAY_PLUGINS, else all)
    # LoRA adapters served beside the model (kvrelay.engine.lora): "NAME=PATH" (or vLLM's JSON) each.
    lora_modules: list[str] | None = None
    enable_lora: bool = False  # serve LoRA adapters: those of --lora-modules, and any loaded at run time
    max_lora_rank: int = 16  # adapters of a higher rank are refused at start-up
    # vLLM's --runner: generate tokens, or pool embeddings (kvrelay.engine.pooling); auto: pooling for a
    # bare-decoder checkpoint (config.json's `LlamaModel`, `Qwen2Model`, ...), else generate.
    runner: str = "auto"
    pooler_config: str | None = None  # JSON overriding the folder's pooler: pooling_type, normalize

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        parser.add_argument(
            "--model", default=d.model, help="Hugging Face model folder (default: bundled stories260K)"
        )
        parser.add_argument(
            "--served-model-name", nargs="+", default=None, metavar="NAME",
            help="model id clients use (default: folder name); more names are aliases the gateway also "
            "accepts and lists, answering with the first",
        )
        parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
        parser.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
        parser.add_argument(
            "--quantization",
            default=None,
            choices=["int8", "fp8"],
            help="int8: weight-only, per output channel; fp8: float8_e4m3fn weights per output channel and "
            "activations per token (GPUs of compute capability 8.9+; on CPU emulated, for tests)",
        )
        parser.add_argument("--block-size", type=int, default=d.block_size)
        parser.add_argument(
            "--kv-cache-memory",
            type=parse_bytes,
            default=None,
            help="memory for the paged KV cache, e.g. 512MiB (default: on CUDA what "
            "--gpu-memory-utilization leaves; " + CPU_KV_RULE.replace("%", "%%") + ")",
        )
        parser.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=d.gpu_memory_utilization,
            help="CUDA: share of the device's memory for weights, activations, graphs and the KV cache, "
            "which gets the rest (default %(default)s; --kv-cache-memory overrides)",
        )
        parser.add_argument(
            "--enforce-eager",
            action="store_true",
            help="CUDA: run every step eagerly (no decode CUDA graphs)",
        )
        parser.add_argument(
            "--piecewise-cuda-graphs",
            action="store_true",
            help="CUDA: steps with prefill replay CUDA graphs of each layer's parts around attention (per "
            "token bucket up to --max-num-batched-tokens) instead of running eagerly; one model process (no TP/PP)",
        )
        parser.add_argument(
            "--async-scheduling",
            action="store_true",
            help="launch each step before reading the previous step's tokens, so scheduling, sampling's "
            "launches and detokenizing overlap the GPU's work (one model process; no speculative decoding)",
        )
        parser.add_argument(
            "--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides memory)"
        )
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        parser.add_argument("--kernel-backend", default=d.kernel_backend, choices=["auto", "torch", "native", "triton"])
        parser.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        parser.add_argument(
            "--cpu-threads", type=_at_least_one, default=None,
            help="CPU engines: torch threads for the forward (default: $OMP_NUM_THREADS if set, else the CPUs "
            "this process may use, from its affinity and cgroup quota, less one for serve's API process)",
        )
        parser.add_argument(
            "--speculative-method",
            default=None,
            choices=["ngram", "draft"],
            help="speculative decoding: ngram proposes tokens by prompt lookup (over the prompt and the output "
            "so far), draft by a smaller model (--speculative-model); verification keeps the output "
            "distribution exactly (default: off)",
        )
        parser.add_argument(
            "--no-speculative-adaptive", dest="speculative_adaptive", action="store_false",
            help="speculate in every step the batch-size limit allows, instead of where measured faster",
        )
        parser.add_argument("--speculative-model", default=None,
                            help="the draft model's folder: same tokenizer and vocabulary as the target")
        parser.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                            help="tokens proposed per sequence and step (1-16)")
        parser.add_argument("--ngram-min", type=int, default=d.ngram_min, help="shortest suffix n-gram looked up")
        parser.add_argument("--ngram-max", type=int, default=d.ngram_max, help="longest suffix n-gram looked up")
        parser.add_argument(
            "--speculative-disable-batch-size",
            type=int,
            default=d.speculative_disable_batch_size,
            help="no speculation in steps that run more sequences than this (a full batch is compute-bound)",
        )
        parser.add_argument(
            "--dummy-seed", type=int, default=d.dummy_seed, help="seed of --load-format dummy weights"
        )
        parser.add_argument(
            "--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
            help="split every layer over this many worker processes, one per GPU (gloo on CPU, NCCL on CUDA)",
        )
        parser.add_argument(
            "--distributed-executor-backend", default=None, choices=["mp", "uni"],
            help="mp: the model runs in worker processes over torch.distributed (also at world size 1); uni: "
            "in this process, world size 1 only (default: mp when tensor x pipeline > 1, else uni)",
        )
        parser.add_argument(
            "--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
            help="split the layers into this many contiguous stages, each on its own tensor-parallel group",
        )
        parser.add_argument(
            "--pipeline-overlap", action=argparse.BooleanOptionalAction, default=d.pipeline_overlap,
            help="pipeline parallel: as many steps in flight as stages, so the stages overlap (default: on CUDA "
            "only); --no-pipeline-overlap: one step at a time, the stages take turns",
        )
        add_multinode_args(parser)
        parser.add_argument(
            "--enable-expert-parallel", action="store_true",
            help="mixture-of-experts models: each tensor-parallel rank holds num_experts / size experts (and "
            "loads only those) instead of every expert; their outputs are summed by one all-reduce per layer",
        )
        parser.add_argument(
            "--plugins", default=None,
            help="load only these plugins (entry-point or package names, comma-separated; default: "
            "$KVRELAY_PLUGINS, else every installed one)",
        )
        parser.add_argument(
            "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
            help="LoRA adapters (PEFT folders) to serve beside the model: a request whose model is NAME runs "
            "with that adapter; also vLLM's JSON form '{\"name\": ..., \"path\": ...}'",
        )
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (implied by --lora-modules); with the gateway's "
                            "--allow-runtime-lora-updating also those loaded through /v1/load_lora_adapter")
        parser.add_argument(
            "--runner", default=d.runner, choices=["auto", "generate", "pooling"],
            help="generate: completions and chat; pooling: embeddings (/v1/embeddings) from an embedding model; "
            "auto: pooling when config.json names the bare decoder (e.g. Qwen2Model), else generate",
        )
        parser.add_argument(
            "--pooler-config", default=None, metavar="JSON",
            help="pooling runner: override the model folder's pooler, e.g. '{\"pooling_type\": \"MEAN\", "
            "\"normalize\": false}' (pooling_type LAST, MEAN or CLS)",
        )
        parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                            help="refuse adapters of a higher rank r")

    @staticmethod
    def cli_flags(args: argparse.Namespace) -> list[str]:
        """The engine flags of args that differ from their defaults, as argv: what `serve
        --disaggregated` hands its local workers, so every engine option reaches them."""
        parser = argparse.ArgumentParser(add_help=False)
        EngineArgs.add_cli_args(parser)
        argv: list[str] = []
        for action in parser._actions:  # argparse has no public iterator over its options
            value = getattr(args, action.dest, action.default)
            if value == action.default or value is None:
                continue
            flag = action.option_strings[0]
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif action.nargs == 0:  # store_true / store_false: present means "not the default"
                argv.append(flag)
            elif isinstance(value, list):  # nargs="+"
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        kw = {k: getattr(args, k) for k in cls.__dataclass_fields__ if hasattr(args, k)}
        names = kw.get("served_model_name")
        if isinstance(names, list):  # --served-model-name NAME [ALIAS ...]
            kw["served_model_name"], kw["served_model_aliases"] = names[0], tuple(names[1:])
        return cls(**kw)


def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's multi-node flags (the engine's and `kvrelay parallel-worker`'s)."""
    parser.add_argument(
        "--nnodes", type=int, default=1,
        help="spread the tensor x pipeline ranks over this many nodes, evenly; the engine is node 0 and every "
        "other node runs `kvrelay parallel-worker` (all with the same $KVRELAY_PARALLEL_TOKEN)",
    )
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, --nnodes)")
    parser.add_argument(
        "--dist-init-addr", default=None,
        help="HOST:PORT of node 0 (the engine) with --nnodes > 1: torch.distributed rendezvous there, the "
        "nodes' control connections on PORT+1",
    )
