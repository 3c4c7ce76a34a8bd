"""The worker's settings: the ``model``, ``workers`` and ``logging`` sections of deploy.yaml.

:class:`WorkerSettings` is all a worker process receives (its run dir's settings file, shipped to
a Ray node as is): no router secret (API keys, admin token) is in it. The launcher composes the
whole file (:class:`launcher.config.DeployConfig`) from these sections and the other roles'.
Every section forbids unknown keys, so a misspelt key is named instead of ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"

# The scheduler's short-before-long defaults, chosen by measurement (docs: "Scheduling")
LONG_PREFILL_TOKEN_THRESHOLD = 256
MAX_LONG_PARTIAL_PREFILLS = 1
LONG_PREFILL_SHARE = 0.25


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(
        DEFAULT_MODEL,
        description="the embedded default (smollm2-135m-instruct, or all-minilm-l6-v2 for embeddings), an HF id "
        "already in the local HF cache, a local HF folder, or a .gguf file",
    )
    served_name: str | None = Field(None, description="the `model` clients send; defaults to `name`")
    task: Literal["auto", "generate", "embed"] = Field(
        "auto",
        description="generate (chat/completions) or embed (/v1/embeddings); auto: embed for an encoder (BERT family) or a sentence-transformers folder, else generate",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto = bfloat16 on GPUs of compute capability >= 8.0, float16 below; on CPU bfloat16 with "
        "avx512_bf16 or AMX, else float32 (worker/contract/dtypes.py)",
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weight-only quantization of the linear layers: auto = a GGUF file's quantized tensors as "
        "stored, a float checkpoint unquantized; none = float weights (a GGUF file dequantized); int8 / int4 = "
        "quantize the float weights at load, per group (embeddings, norms and the LM head stay float)",
    )
    max_model_len: Annotated[int, Field(ge=16, le=1_048_576)] | Literal["auto"] = Field(
        "auto",
        description="prompt + completion tokens per request; auto: the model's own context length "
        "(max_position_embeddings), reduced to what the KV cache holds for one sequence (launcher.plan.context)",
    )
    random_init: bool = Field(
        False,
        description="for benchmarking only: build the model from config.json with "
        "random weights (no weight files needed); its answers are noise",
    )

    @property
    def public_name(self) -> str:
        return self.served_name or self.name


class WorkersConfig(Section):
    devices: Literal["auto", "cpu"] | list[int] = Field(
        "auto", description="auto (every GPU, else CPU) | cpu | physical GPU indices as nvidia-smi numbers them"
    )
    replicas: Literal["auto"] | int = Field(
        "auto", description="auto = one per GPU (one on CPU); on CPU a number splits the cores into disjoint sets"
    )
    gpus_per_replica: int = Field(
        1, ge=1, le=64, description="GPUs per replica; >1 splits layers across them (not tensor parallel)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="ranks per replica, one per GPU (or CPU core set), each holding 1/N of every layer; heads, KV "
        "heads and the MLP width must divide by N; exclusive with gpus_per_replica > 1; local backend only",
    )
    workers_per_gpu: int = Field(1, ge=1, le=16, description="small replicas sharing one GPU")
    max_num_seqs: int = Field(8, ge=1, le=1024, description="sequences decoded together in one batch")
    enforce_eager: bool = Field(
        False,
        description="run every step through the eager forward pass: no captured decode step (vLLM's flag)",
    )
    max_waiting: int = Field(
        64, ge=0, le=100_000, description="requests queued per worker before the router answers 429"
    )
    max_prefill_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="prompt tokens prefilled per engine step while others decode (chunked prefill); auto: on CPU "
        "each chunk is sized by step costs measured at start so that a step beside decodes takes at most 3x a decode "
        "step of its rows, the chunk's attention over the prompt before it included (a document's later chunks are "
        "shorter), 2048 on GPU; a step with nothing to decode takes four chunks of a prompt's start (at least 64 "
        "tokens, at most 512) on CPU, 8192 on GPU; a number sets both",
    )
    long_prefill_token_threshold: int = Field(
        LONG_PREFILL_TOKEN_THRESHOLD,
        ge=1,
        description="a prompt with more tokens than this to compute is long: short ones are prefilled first each "
        "step, also ahead of long ones queued before them (vLLM's long_prefill_token_threshold)",
    )
    max_long_partial_prefills: int = Field(
        MAX_LONG_PARTIAL_PREFILLS,
        ge=1,
        le=1024,
        description="long prompts prefilled at once; the others wait their turn (vLLM's max_long_partial_prefills)",
    )
    long_prefill_share: float = Field(
        LONG_PREFILL_SHARE,
        gt=0,
        le=1.0,
        description="the least share of a step's prefill budget kept for long prompts while short ones want it all, "
        "so a long prompt is never starved",
    )
    max_queue_wait_s: float = Field(
        120.0, gt=0, description="a queued request waits at most this for KV memory, then gets 503 with Retry-After"
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="KV-cache budget per CPU worker, GiB, allocated at start (per rank with tensor parallel)"
    )
    deterministic: bool = Field(
        True,
        description="batch-invariant serving: a sequence's logits the same bit for bit whatever shares its step, "
        "however its prompt was chunked and on every replica of the revision (a migrated stream continues with "
        "identical text); false: the fastest kernel per batch size and SDPA's prefill attention (faster prefill), "
        "a migrated stream then continues validly but not identically",
    )
    adapt_threads: bool = Field(
        True,
        description="CPU workers: compute on fewer threads while other processes take their cores (the threads' "
        "run-queue wait says so), all of them again once the cores are free; false: always one thread per core",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1.0,
        description="share of a GPU's memory a worker may use: weights, activations, KV cache and a 1 GiB allowance",
    )
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="how often a worker reports its load to the router")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="a silent worker is declared dead after this")
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a worker with work, no engine step and next to no CPU used for this long is declared dead "
        "(with no step for 4 times this long, whatever its CPU)",
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="a worker must be ready within this")

    @field_validator("replicas")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("replicas must be >= 1 or 'auto'")
        return v

    @model_validator(mode="after")
    def _one_split(self) -> WorkersConfig:
        if self.tensor_parallel_size > 1 and self.gpus_per_replica > 1:
            raise ValueError(
                f"workers.tensor_parallel_size={self.tensor_parallel_size} and workers.gpus_per_replica="
                f"{self.gpus_per_replica} are exclusive (tensor parallel or a layer split): set one of them to 1"
            )
        return self

    @property
    def gpus_per_slot(self) -> int:
        """GPUs one replica takes: ``tensor_parallel_size`` ranks or a ``gpus_per_replica`` layer split."""
        return max(self.tensor_parallel_size, self.gpus_per_replica)

    def prefill_budgets(self, on_gpu: bool) -> tuple[int, int]:
        """Prompt tokens one engine step computes while others decode, and when nothing decodes.
        ``auto``: on GPU 2048 and 8192; on CPU, where a prefill is compute-bound, 32 and 512, and the
        worker then measures its step costs (``worker.replica.calibrate_step_cost``) and sizes each
        chunk beside decodes by them (``worker.step_cost``: a step within 3x a decode step)."""
        if self.max_prefill_tokens == "auto":
            return (2048, 8192) if on_gpu else (32, 512)
        return self.max_prefill_tokens, self.max_prefill_tokens


class LoggingConfig(Section):
    format: Literal["text", "json"] = Field("text", description="json: one JSON object per line, every process")
    level: Literal["debug", "info", "warning", "error"] = "info"


class WorkerSettings(Section):
    """What one worker process is told: the model to load, its engine's limits, how to log."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
