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


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(
        DEFAULT_MODEL, description="alias of the embedded default, an HF id, a local HF folder, or a .gguf path"
    )
    served_name: str | None = Field(None, description="the `model` clients send; defaults to `name`")
    task: Literal["auto", "generate", "embed"] = Field(
        "auto",
        description="generate (chat/completions) or embed (/v1/embeddings); auto: embed for an encoder (BERT family) or a sentence-transformers folder, else generate",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weight-only quantization of the linear layers: auto = a GGUF file's quantized tensors as "
        "stored, a float checkpoint unquantized; none = float weights (a GGUF file dequantized); int8 / int4 = "
        "quantize the float weights at load, per group (embeddings, norms and the LM head stay float)",
    )
    max_model_len: int = Field(2048, ge=16, le=1_048_576, description="prompt + completion tokens per request")
    random_init: bool = Field(
        False,
        description="for benchmarking only: build the model from config.json with "
        "random weights (no weight files needed); its answers are noise",
    )

    @property
    def public_name(self) -> str:
        return self.served_name or self.name


class WorkersConfig(Section):
    devices: Literal["auto", "cpu"] | list[int] = Field("auto", description="auto | cpu | physical GPU indices")
    replicas: Literal["auto"] | int = Field("auto", description="auto = one per GPU (one on CPU)")
    gpus_per_replica: int = Field(
        1, ge=1, le=64, description="GPUs per replica; >1 splits layers across them (not tensor parallel)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="ranks per replica, one per GPU (or CPU core set), each holding 1/N of every layer",
    )
    workers_per_gpu: int = Field(1, ge=1, le=16, description="small replicas sharing one GPU")
    max_num_seqs: int = Field(8, ge=1, le=1024, description="sequences decoded together in one batch")
    max_waiting: int = Field(
        64, ge=0, le=100_000, description="requests queued per worker before the router answers 429"
    )
    max_prefill_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="prompt tokens prefilled per engine step while others decode (auto: measured at start on "
        "CPU, 2048 on GPU)",
    )
    max_queue_wait_s: float = Field(
        120.0, gt=0, description="a queued request waits at most this for KV memory, then gets 503 with Retry-After"
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache budget per CPU worker, GiB")
    deterministic: bool = Field(
        True,
        description="batch-invariant serving: a sequence's logits the same bit for bit whatever shares its step, "
        "however its prompt was chunked and on every replica of the revision (exact migration); off: the "
        "fastest kernels per row count",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="share of a GPU's memory a worker may use")
    heartbeat_s: float = Field(1.0, gt=0, le=60)
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
        worker then measures the first (``worker.replica.calibrate_prefill_tokens``: the largest
        chunk that keeps a step within twice a decode step)."""
        if self.max_prefill_tokens == "auto":
            return (2048, 8192) if on_gpu else (32, 512)
        return self.max_prefill_tokens, self.max_prefill_tokens


class LoggingConfig(Section):
    format: Literal["text", "json"] = "text"
    level: Literal["debug", "info", "warning", "error"] = "info"


class WorkerSettings(Section):
    """What one worker process is told: the model to load, its engine's limits, how to log."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
