"""Engine profiles: how each engine version counts the memory beside weights and KV cache. Pure: no I/O.

vLLM sizes its KV cache from ``gpu_memory_utilization`` x the card, less the weights and
what its profiling run measured; what it measures changed from version to version, so the
planner plans for a version, never for "vLLM". Each profile covers a range of versions
and was fitted on public start-up logs of that range (``tests/data/vllm_observed.jsonl``,
the figures in docs/benchmarks.md):

* the sampler's dummy pass: ``max_num_seqs`` x vocab x fp32, ``sampler_copies`` times over
  (0.11 to 0.15 warmed top-p/top-k too: 9.75 copies on their logs, the ~9.6-9.9 llm-d's 0.11.0 table prints as
  its activation peak at 1,024 sequences; 0.16-0.20 ~5; 0.21-0.28 ~1.5;
  0.29+ ~3.5).
  Up to 0.10 it differed by card: ~5 copies with a small card's batch (the A100 and A10 logs), 9.5 with
  a large card's (an H100 log of 0.10.1), so a profile may say ``large_sampler_copies``;
* memory outside torch that the profile counts (``non_torch_gib``), as its logs print it;

The copies are fitted, not chosen: ``benchmarks/calibration.py --fit`` prints what the fit gives,
and the figures here are that; its table scores them in sample and leave-one-source-out.
* the defaults of ``max_num_batched_tokens`` / ``max_num_seqs`` and which cards get the
  larger ones (a card under 70 GiB profiles 2,048 tokens in every range: the compile ranges its logs print end
  there), and the default ``--gpu-memory-utilization`` (0.92 from 0.29);
* from 0.21, a first start's torch.compile transient on one GPU (``cold_compile_gib``, ``COLD_COMPILE_GIB``);
* where CUDA graphs live: before 0.20 they are captured after the cache is sized, out of
  the 1 - utilization slack (from 0.10 with the profiling run's activation free again beside it:
  Qwen3-30B-A3B-FP8 at tp 2 on L40S under 0.10.2 at 0.95 and Qwen3-VL-30B-A3B at tp 4 on RTX 3090s
  under 0.11.0, which captured 1.92 GiB beside 1.86 of slack, started; Qwen3-30B-A3B at tp 4 on A10s
  under 0.8.5 at 0.9 sized its cache and died capturing, vLLM issue 17469); from 0.20 vLLM profiles them and takes them from the budget (its
  message says "default since v0.21.0", but 0.20.2's logs already print the subtraction).

llama.cpp has one profile: its compute buffer does not depend on the build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.errors import PlanError

GIB = 1024**3
MIB = 1024**2
LARGE_CARD_BYTES = 70 * GIB
# What a cold start's first torch.compile leaves in the profiled peak from 0.21 (the V2 model runner compiles inside
# the profiling run; a warm start loads the compiled artifact instead): measured, not fitted, as the median of the two
# public logs that print the same start cold and warm: roy6n23/vllm-tp2-profiling's 0.30.0 H100 (Llama-3.1-8B,
# 52.52 GiB of KV cold, 53.70 warm: 1.18) and alexostapiuk11/coldstart-recon-worker's 0.27.1 fixture (1.18 GiB of
# activation cold, 0.19 warm: 0.99). The cold logs beside them agree: Qwen3-14B on an L40S under 0.29.0 at 2,048
# batched tokens holds 1.48 GiB of activation where its forward pass is ~0.3.
COLD_COMPILE_GIB = 1.09


@dataclass(frozen=True)
class EngineProfile:
    """The overhead model of one engine over a range of its versions."""

    engine: str  # vllm | llama.cpp
    since: tuple[int, ...]  # the first version it covers
    until: tuple[int, ...] | None  # the first version it no longer covers
    version: str  # what a plan names when only the range is known: the newest version its logs ran
    sampler_copies: float = 3.0
    large_sampler_copies: float = 0.0  # with a large card's max_num_batched_tokens (0: sampler_copies)
    non_torch_gib: float = 0.13
    allreduce_gib: float = 0.42
    default_util: float = 0.9
    graphs_in_budget: bool = False
    large_batch: tuple[int, int] = (8192, 1024)  # max_num_batched_tokens, max_num_seqs on a large card
    small_batch: tuple[int, int] = (2048, 256)
    a100_is_small: bool = True  # the A100 80GB gets the small defaults even though it has 70 GiB or more
    # How its log counts "GPU KV cache size: N tokens": before 0.20 its blocks shared among the layer groups
    # (a hybrid's token costs its attention and linear layers' pages); from 0.20 how many sequences of
    # max_model_len fit, times that length (Gemma-4-26B-A4B under 0.20.2: 984,297 tokens, no block multiple).
    tokens_by_concurrency: bool = False
    # gpt-oss's mxfp4 experts on Hopper: the OAI Triton kernels (from 0.11), else Marlin's padding (0.10.1).
    mxfp4_hopper_triton: bool = True
    # Where graphs are captured after the cache is sized: the first version whose profiling run's activation is free
    # again when it captures (the budget counted it, the cache never took it), so that the capture may use it too.
    capture_reuses_profile_since: tuple[int, ...] = (0, 10)
    # A first start's torch.compile, which runs inside the profiling run where no compiled artifact is cached yet: its
    # transient lands in the profiled peak (see COLD_COMPILE_GIB). 0: not seen in this range's logs.
    cold_compile_gib: float = 0.0

    def capture_reuses_profile(self, version: str) -> bool:
        """Whether this version captures its CUDA graphs into memory that its profiling run's activation held (a
        version the range does not name: the newest of the range, ``self.version``)."""
        try:
            v = parse_version(version) if version else parse_version(self.version)
        except PlanError:
            v = parse_version(self.version)
        return v >= self.capture_reuses_profile_since

    @property
    def name(self) -> str:
        first = ".".join(map(str, self.since))
        if self.until is None:
            return f"{self.engine} {first}+" if self.since != (0,) else self.engine
        last = ".".join(map(str, self.until[:-1] + (self.until[-1] - 1,)))
        return f"{self.engine} {first}" if first == last else f"{self.engine} {first}–{last}"

    def covers(self, version: tuple[int, ...]) -> bool:
        return version >= self.since and (self.until is None or version < self.until)

    def copies(self, batched_tokens: int) -> float:
        """How many vocab-sized fp32 copies the sampler's dummy pass holds at this batch."""
        if self.large_sampler_copies and batched_tokens >= self.large_batch[0]:
            return self.large_sampler_copies
        return self.sampler_copies

    def batch(self, gpu_class: str, memory_mib: int) -> tuple[int, int]:
        """vLLM's OpenAI-server defaults of max_num_batched_tokens and max_num_seqs on this card."""
        large = memory_mib * MIB >= LARGE_CARD_BYTES and not (self.a100_is_small and "a100" in gpu_class.lower())
        return self.large_batch if large else self.small_batch


# Oldest first. The V0 engine (before 0.8) profiled max_model_len tokens: the oldest V1 profile is
# the nearest there is, and the plan says which profile it used.
VLLM_PROFILES: tuple[EngineProfile, ...] = (
    # sampler_copies / large_sampler_copies: what benchmarks/calibration.py's fit gives on the set (a grid by a
    # quarter, least squares in units of each row's tolerance); non_torch_gib: the median the logs print on one GPU,
    # 0.13 (no range has two sources that print their own). tests/test_calibration.py checks that the fit still gives these.
    EngineProfile("vllm", (0, 8), (0, 11), "0.10.1", sampler_copies=5.0, large_sampler_copies=9.5,
                  mxfp4_hopper_triton=False),
    EngineProfile("vllm", (0, 11), (0, 12), "0.11.0", sampler_copies=9.75),
    # 0.12-0.15 still warmed the sampler as 0.11 did (an RTX A5000 log of 0.13.0, an H200 one of 0.15.1);
    # from 0.16 ~5 copies (0.16.0 on L40S, 0.17.1 on MI300X, 0.19.1 on an A100 40GB, 0.20.2 on an RTX PRO 6000).
    # 0.20 already takes the CUDA graphs from the budget (its logs print the "equivalent to" line; 0.19.1's do not).
    EngineProfile("vllm", (0, 12), (0, 16), "0.15.1", sampler_copies=9.75),
    EngineProfile("vllm", (0, 16), (0, 20), "0.19.1", sampler_copies=4.75),
    EngineProfile("vllm", (0, 20), (0, 21), "0.20.2", sampler_copies=5.0, graphs_in_budget=True,
                  tokens_by_concurrency=True),
    # ~1.5 copies: Qwen3-32B at tp 2 on a 96 GB card under 0.27.1 left 1.66 GiB beside weights and KV in all,
    # less than 3 copies of 1,024 sequences' logits alone (1.74 GiB).
    # A card under 70 GiB still profiles 2,048 batched tokens (the 0.26.0 A40 logs and the 0.29.0 L40S ones print
    # "compile range (1, 2048)"); what 0.26.0's A40 log holds beyond that forward pass ("1.01 GiB for peak activation"
    # for Llama-3.1-8B, 0.25 of forward pass) is its first start's compile, COLD_COMPILE_GIB.
    EngineProfile("vllm", (0, 21), (0, 29), "0.28.0", sampler_copies=1.5, graphs_in_budget=True,
                  tokens_by_concurrency=True, cold_compile_gib=COLD_COMPILE_GIB),
    EngineProfile("vllm", (0, 29), None, "0.31.0", sampler_copies=3.5, graphs_in_budget=True,
                  default_util=0.92, a100_is_small=False, tokens_by_concurrency=True, cold_compile_gib=COLD_COMPILE_GIB,
                  non_torch_gib=0.27),
)
LLAMACPP_PROFILE = EngineProfile("llama.cpp", (0,), None, "", default_util=0.9)
NEWEST = VLLM_PROFILES[-1]

_VERSION = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, ...]:
    """``0.17.1``, ``v0.11.0``, ``0.20.2rc1.dev9+g01d4d1a``, ``vLLM 0.10.1.1`` or llama.cpp's
    ``version: 4567 (abc123)`` as a comparable tuple; PlanError when there is no number in it."""
    found = _VERSION.search(text)
    if found is None:
        raise PlanError(f"engine version {text!r} has no version number; write e.g. 0.17.1")
    return tuple(int(g) for g in found.groups() if g is not None)


def profile_for(engine: str, version: str) -> EngineProfile:
    """The profile of an engine version; "" is the newest profile."""
    if engine != "vllm":
        return LLAMACPP_PROFILE
    if not version:
        return NEWEST
    v = parse_version(version)
    for p in VLLM_PROFILES:
        if p.covers(v):
            return p
    return VLLM_PROFILES[0] if v < VLLM_PROFILES[0].since else NEWEST


def planned_version(engine: str, version: str) -> str:
    """The version a plan names: the one asked for (or reported), else the newest profile's."""
    if version:
        return version.strip().removeprefix("v")
    return NEWEST.version if engine == "vllm" else ""


def fleet_version(reported: list[str]) -> str:
    """The version the fleet's agents run: the one most of them report (a tie: the oldest), "" when none does."""
    counts: dict[str, int] = {}
    keys: dict[str, tuple[int, ...]] = {}
    for text in reported:
        try:
            keys[text] = parse_version(text)
        except PlanError:
            continue
        counts[text] = counts.get(text, 0) + 1
    if not counts:
        return ""
    best = min(counts, key=lambda t: (-counts[t], keys[t]))
    return best.strip().removeprefix("v")
