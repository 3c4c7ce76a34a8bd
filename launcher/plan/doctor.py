"""``llamadeploy doctor``: the environment drift checks, one row each.

Python, torch and the CUDA it was built for, whether CUDA works, the driver and the CUDA version
it supports (NVML), whether the torch wheel has kernels for each GPU's compute capability, each
GPU (MIG instances, GPUs NVML cannot query, NVML missing while CUDA works), the GPUs' interconnect
(NVLink or PCIe, for tensor parallelism), ``CUDA_VISIBLE_DEVICES``,
transformers/accelerate, then for each served model (grouped by model): its files, what ``model.dtype`` means on its placed devices, the quantization in
effect and the weights' bytes it holds, the kernel each linear weight shape would run
here (measured), placement and the memory plan, and the router's ports. A row is ``ok``, ``warn``, ``fail`` or ``skip`` (cannot be
checked here, e.g. no GPU); any ``fail`` makes the command exit 1.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from launcher.config import DeployConfig
from launcher.plan.placement import GpuInfo, Inventory, PlacementError, nvml_missing_error, place, visible_gpus
from worker.contract.settings import ModelConfig
from worker.contract.units import GiB

TORCH_INDEX = "https://download.pytorch.org/whl/cuXYZ"


@dataclass(frozen=True)
class Check:
    """One row: ``status`` is ok | warn | fail | skip; ``fix`` says what to do when not ok."""

    name: str
    status: str
    detail: str
    fix: str = ""


def cuda_version(value: int | None) -> str | None:
    """NVML's integer CUDA version (12040) as text ("12.4")."""
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"


def cuda_compat(torch_cuda: str | None, driver_cuda: str | None, kernel_ran: bool = False) -> Check:
    """Compare the CUDA torch was built for with the newest the driver supports.

    A newer major version cannot run (fail) — unless ``kernel_ran`` (the "CUDA works" row ran a
    real kernel), which means forward-compatibility libraries (``cuda-compat``, common in NVIDIA's
    containers) bridge the gap: then it is a warning. A newer minor version within the same major
    runs through CUDA's minor-version compatibility, except features needing a newer driver such
    as PTX JIT (warn). Versions are "major.minor" strings.
    """
    name = "CUDA build vs driver"
    if torch_cuda is None:
        return Check(name, "skip", "torch is a CPU-only build")
    if driver_cuda is None:
        return Check(name, "skip", f"torch built for CUDA {torch_cuda}; no driver to compare with")
    built, supported = _version(torch_cuda), _version(driver_cuda)
    detail = f"torch built for CUDA {torch_cuda}, driver supports up to {driver_cuda}"
    if built <= supported:
        return Check(name, "ok", detail)
    fix = (
        f"upgrade the NVIDIA driver to one supporting CUDA {torch_cuda}, or install a torch built for CUDA "
        f"≤ {driver_cuda} (pip install torch --index-url {TORCH_INDEX}, cuXYZ from pytorch.org/get-started)"
    )
    if built[0] > supported[0] and kernel_ran:
        return Check(
            name,
            "warn",
            detail + ": a test kernel ran anyway (CUDA forward-compatibility libraries, as in "
            "NVIDIA's containers); those support only data-centre GPUs and some features",
            fix,
        )
    if built[0] > supported[0]:
        return Check(name, "fail", detail + ": this torch cannot use the GPUs", fix)
    return Check(name, "warn", detail + ": runs via minor-version compatibility, but PTX JIT kernels may fail", fix)


def wheel_runs_on(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``: ``sm_80``,
    ``sm_90a``, ``compute_90``...) has kernels for a GPU of compute ``capability``.

    CUDA's rules: a cubin for ``sm_XY`` runs on X.Y' with Y' ≥ Y of the same major X; an
    arch-specific ``sm_XYa`` only on exactly X.Y; PTX (``compute_XY``) is JIT-compiled for any
    capability ≥ X.Y. An empty list (a CPU build) runs nowhere.
    """
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        specific = digits.endswith(("a", "f"))
        digits = digits.rstrip("af")
        if not digits.isdigit() or len(digits) < 2:
            continue
        built = (int(digits[:-1]), int(digits[-1]))
        if kind == "compute" and capability >= built:
            return True
        if kind == "sm" and (capability == built if specific else capability[0] == built[0] and capability >= built):
            return True
    return False


def arch_checks(gpus: list[GpuInfo], arch_list: list[str] | None) -> list[Check]:
    """One row per physical GPU whose compute capability this torch wheel has no kernels for
    (e.g. V100, sm70, after torch dropped it); one ok row when every GPU is covered."""
    name = "torch kernels for the GPUs"
    known = {g.index: g for g in gpus if g.capability}
    if not known:
        return [Check(name, "skip", "no GPU with a known compute capability")]
    if not arch_list:
        return [Check(name, "skip", "torch lists no CUDA architectures (a CPU-only build)")]
    rows = []
    for g in known.values():
        major, minor = g.capability
        if not wheel_runs_on(g.capability, arch_list):
            rows.append(
                Check(
                    f"GPU {g.index} kernels",
                    "fail",
                    f"{g.name} is compute capability {major}.{minor}, but this torch has kernels for "
                    f"{' '.join(arch_list)} only: it cannot run there",
                    "install a torch build that still supports this GPU (an older release, or a CUDA "
                    "build listing it; pytorch.org/get-started/previous-versions)",
                )
            )
    if rows:
        return rows
    caps = sorted({f"{c[0]}.{c[1]}" for c in (g.capability for g in known.values())})
    return [Check(name, "ok", f"compute capability {', '.join(caps)} covered by {' '.join(arch_list)}")]


def placed_device(cfg: DeployConfig, inv: Inventory, specs: list | None = None) -> tuple[str, list]:
    """``("cuda" | "cpu", compute capabilities)`` of the devices the workers would be placed on
    (``specs``: where they were placed; else placed here; CPU when the placement fails: its own
    check reports why)."""
    try:
        specs = place(cfg.workers, inv) if specs is None else specs
    except PlacementError:
        specs = []
    gpu_info = [g for s in specs for g in s.gpu_info]
    return ("cuda" if gpu_info else "cpu"), [g.capability for g in gpu_info if g.capability]


def dtype_check(cfg: DeployConfig, inv: Inventory, specs: list | None = None) -> Check:
    """What ``model.dtype`` means on this hardware (``dtype: auto`` as the worker resolves it) on
    the devices the model's workers are placed on (``specs``, as :func:`placed_device`)."""
    line = load_plan(cfg, inv, None, specs).dtype_note
    warned = "warning:" in line
    return Check("dtype", "warn" if warned else "ok", line, "set model.dtype: auto" if warned else "")


def kernels_check(cfg: DeployConfig, inv: Inventory, shape, specs: list | None = None) -> Check:
    """The kernel table a worker would choose here (:mod:`launcher.plan.doctor_kernels`), in the dtype
    ``model.dtype`` resolves to on the devices the model's workers are placed on (``specs``);
    not measured here for an embedding model (:mod:`launcher.plan.doctor_embed`)."""
    from launcher.plan.doctor_embed import kernels_row
    from launcher.plan.doctor_kernels import kernel_check

    if shape is not None and shape.embed is not None:
        return Check("kernels", *kernels_row(shape))

    plan = load_plan(cfg, inv, shape, specs)
    if plan.on_gpu and not _cuda_runs():
        return Check("kernels", "skip", "the workers would run on GPUs this process cannot use")
    return Check("kernels", *kernel_check(cfg, shape, plan.device, plan.dtype))


def load_plan(cfg: DeployConfig, inv: Inventory, shape, specs: list | None = None):
    """The load plan a worker of ``cfg`` would resolve on the devices it is placed on (``specs``, as
    :func:`placed_device`): the worker's own rule (:func:`worker.contract.load_plan.resolve_load_plan`),
    over ``shape`` (None: not read) and the CPU flags of ``inv``."""
    from worker.contract.load_plan import Machine, ModelFacts, resolve_load_plan

    device, caps = placed_device(cfg, inv, specs)
    facts = ModelFacts(cfg.model.name, config=shape, stored=getattr(shape, "gguf_types", None))
    return resolve_load_plan(cfg.model, cfg.workers, Machine(device, tuple(caps), cpu_flags=inv.cpu_flags), facts)


def _cuda_runs() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 -- a broken install: the torch row already says so
        return False


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def python_check() -> Check:
    return Check("python", "ok", f"{platform.python_version()} ({sys.executable})")


def torch_checks(gpus_present: bool) -> tuple[list[Check], str | None]:
    """Rows for torch's version/build and whether CUDA works; also returns torch's CUDA version."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 -- a broken CUDA install fails the import in many ways
        return [Check("torch", "fail", f"import failed: {exc}", "pip install 'torch>=2.4'")], None
    built = torch.version.cuda
    rows = [Check("torch", "ok", f"{torch.__version__}, built for " + (f"CUDA {built}" if built else "CPU only"))]
    if not torch.cuda.is_available():
        if not gpus_present:
            rows.append(Check("CUDA works", "skip", "no NVIDIA GPU here; CUDA not checked"))
        elif built is None:
            rows.append(
                Check(
                    "CUDA works",
                    "fail",
                    f"GPUs present but torch {torch.__version__} is a CPU-only build",
                    "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
                )
            )
        else:
            rows.append(
                Check(
                    "CUDA works",
                    "fail",
                    "GPUs present but torch.cuda.is_available() is False",
                    "check the driver/CUDA rows above and CUDA_VISIBLE_DEVICES",
                )
            )
        return rows, built
    try:
        count = torch.cuda.device_count()
        value = torch.ones(4, device="cuda:0").sum().item()  # a real kernel launch, not just a query
        rows.append(
            Check(
                "CUDA works",
                "ok" if value == 4 else "fail",
                f"{count} device(s) visible to torch; a kernel on cuda:0 ran ({torch.cuda.get_device_name(0)})",
            )
        )
    except RuntimeError as exc:  # torch's CUDA errors (AcceleratorError included) derive from it
        rows.append(
            Check(
                "CUDA works",
                "fail",
                f"a kernel on cuda:0 failed: {exc}",
                "check the driver/CUDA rows; `nvidia-smi` must work first",
            )
        )
    return rows, built


def driver_check() -> tuple[Check, str | None]:
    """NVML's driver version and the newest CUDA it supports."""
    skipped = "no NVIDIA driver or libnvidia-ml here; driver and GPU checks skipped"
    try:
        import pynvml
    except ImportError:
        return Check(
            "NVIDIA driver", "skip", f"nvidia-ml-py is not installed; {skipped}", "pip install nvidia-ml-py"
        ), None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Check("NVIDIA driver", "skip", f"NVML unavailable ({exc.__class__.__name__}): {skipped}"), None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver if isinstance(driver, str) else driver.decode()
        supported = cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())
    except pynvml.NVMLError as exc:
        return Check(
            "NVIDIA driver",
            "fail",
            f"NVML started but cannot read the driver: {exc}",
            "`nvidia-smi` must work first (driver/kernel module mismatch after an upgrade needs a reboot)",
        ), None
    finally:
        pynvml.nvmlShutdown()
    return Check("NVIDIA driver", "ok", f"{driver}, supports CUDA up to {supported}"), supported


def visibility_check(inv: Inventory) -> Check:
    """What the inherited CUDA_VISIBLE_DEVICES maps to, in physical indices."""
    name = "CUDA_VISIBLE_DEVICES"
    if not inv.gpus:
        value = "unset" if inv.visible_env is None else f"set to {inv.visible_env!r}"
        return Check(name, "skip", f"{value}; no GPU here to map it to")
    if inv.visible_env is None:
        return Check(name, "ok", "unset: every GPU is available; deploy.yaml indices are physical (nvidia-smi)")
    try:
        gpus = visible_gpus(inv)
    except PlacementError as exc:
        return Check(name, "fail", str(exc), "fix or unset CUDA_VISIBLE_DEVICES")
    seen = ", ".join(f"cuda:{i} = physical {g.index}" for i, g in enumerate(gpus)) or "no GPU"
    detail = f"{inv.visible_env!r}: {seen}. deploy.yaml indices stay physical"
    mixed = len({g.name for g in inv.gpus}) > 1
    if (
        mixed
        and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
        and any(e.strip().isdigit() for e in inv.visible_env.split(","))
    ):
        return Check(
            name,
            "warn",
            detail + "; GPU models differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so other "
            "programs may number them differently",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID, or use GPU UUIDs",
        )
    return Check(name, "ok", detail)


def gpu_checks(inv: Inventory) -> list[Check]:
    """One row per GPU (or MIG instance) NVML lists, one per GPU it could not query, and a failing
    row when NVML is missing while CUDA sees GPUs; warns when other processes use a sizeable part."""
    if message := nvml_missing_error(inv):
        return [Check("GPUs", "fail", message, "make NVML available, or set workers.devices: cpu")]
    if not inv.gpus and not inv.gpu_problems:
        return [Check("GPUs", "skip", "none found (NVML lists no GPU)")]
    rows = []
    for g in inv.gpus:
        cap = f", compute capability {g.capability[0]}.{g.capability[1]}" if g.capability else ""
        detail = f"{g.name}, {g.total_bytes / GiB:.1f} GiB total, {g.free_bytes / GiB:.1f} GiB free{cap}, {g.uuid}"
        busy = g.used_bytes > 0.10 * g.total_bytes
        rows.append(
            Check(
                f"GPU {g.index}" + (" MIG" if g.is_mig else ""),
                "warn" if busy else "ok",
                detail,
                "other processes hold memory here (nvidia-smi shows which)" if busy else "",
            )
        )
    for p in inv.gpu_problems:
        rows.append(
            Check(
                f"GPU {p.index}",
                "fail",
                p.message,
                f"nvidia-smi -q -i {p.index}; or leave it out of workers.devices / CUDA_VISIBLE_DEVICES",
            )
        )
    return rows


def interconnect_check(cfg: DeployConfig, inv: Inventory, nvml=None) -> Check:
    """How the GPUs this deployment may use are connected (:func:`launcher.plan.interconnect.gpu_links`).
    PCIe between two GPUs of one replica is a warning when ``tensor_parallel_size`` > 1: its
    per-layer all-reduces over PCIe make tensor parallelism gain little over one card (PCIe between
    replicas, and data parallel, are unaffected)."""
    from launcher.plan.interconnect import PCIE, gpu_links

    name = "GPU interconnect"
    try:
        indices = sorted({g.index for g in visible_gpus(inv) if not g.is_mig})
    except PlacementError:
        indices = sorted({g.index for g in inv.gpus if not g.is_mig})
    if len(indices) < 2:
        return Check(name, "skip", f"{len(indices)} GPU(s): no link between GPUs to check (tensor parallel needs 2+)")
    links, error = gpu_links(indices, nvml)
    if error:
        return Check(name, "skip", error)
    pcie = [lk for lk in links if lk.kind == PCIE]
    if not pcie:
        return Check(
            name,
            "ok",
            f"NVLink between every pair of GPUs {indices}: tensor parallel gains (about ×1.7 for 13B on two cards)",
        )
    detail = (
        "; ".join(lk.describe() for lk in links)
        + ". Tensor parallelism over PCIe gains little over one card (its all-reduce per layer crosses PCIe: "
        "about ×1.3 for 13B on two cards, ×1.7 over NVLink); data parallel is unaffected"
    )
    tp = cfg.workers.tensor_parallel_size
    if tp > 1 and _pcie_inside_a_replica(cfg, inv, pcie):
        return Check(
            name,
            "warn",
            detail,
            f"with tensor_parallel_size: {tp} prefer NVLink-connected GPUs, or data parallel "
            "(tensor_parallel_size: 1) where a replica fits one GPU",
        )
    return Check(name, "ok", detail)


def _pcie_inside_a_replica(cfg: DeployConfig, inv: Inventory, pcie: list) -> bool:
    """Whether one of the ``pcie`` links joins two GPUs of the same replica as ``place`` lays them
    out (the ranks' all-reduces cross only those); any PCIe link counts when placement fails."""
    try:
        groups = [set(spec.gpus) for spec in place(cfg.workers, inv)]
    except PlacementError:
        return True
    return any({lk.a, lk.b} <= g for lk in pcie for g in groups)


def library_checks() -> list[Check]:
    rows = []
    for dist, why in (("transformers", "loads the model"), ("accelerate", "needed for gpus_per_replica > 1")):
        try:
            module = __import__(dist)
            rows.append(Check(dist, "ok", module.__version__))
        except ImportError as exc:
            rows.append(Check(dist, "fail", f"import failed ({exc}); {why}", f"pip install {dist}"))
    return rows


def model_check(model: ModelConfig) -> tuple[Check, object]:
    """The ``model`` section's config and files, without loading weights; returns the shape for the
    plan (with its embedding spec when the model is served for embeddings, as ``plan`` reads it)."""
    from launcher.models import ModelNotFound
    from launcher.plan import doctor_embed
    from launcher.plan.shape import config_folder, read_shape
    from worker.contract.shapes import ShapeError

    name = model.name
    try:
        shape = read_shape(name, model)
    except (ModelNotFound, ShapeError) as exc:
        return Check("model", "fail", str(exc), "point model.name at a local folder, .gguf file or cached HF id"), None
    source, folder = Path(shape.source), config_folder(shape)
    size = doctor_embed.about(name, shape) if shape.embed else f"{name}: {shape.params / 1e9:.3f} B parameters"
    about = f"{size}, config from {source}"
    if folder is None:
        return Check("model", "ok", about + "; converted to safetensors on the first `up`"), shape
    weights = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    tokenizer = [p for p in ("tokenizer.json", "tokenizer.model") if (folder / p).is_file()]
    # with model.random_init the worker draws the weights: a benchmark's folder holds none
    needed = (("weights (*.safetensors)", weights or model.random_init), ("tokenizer", tokenizer))
    if missing := ", ".join(w for w, have in needed if not have):
        return Check("model", "fail", f"{about}; {folder} lacks {missing}", "download the complete checkpoint"), shape
    if model.random_init:
        return Check("model", "ok", f"{about}; random weights (model.random_init), {tokenizer[0]}"), shape
    return Check("model", "ok", f"{about}; {len(weights)} weight file(s), {tokenizer[0]}"), shape


def quantization_check(cfg: DeployConfig, inv: Inventory, shape, specs: list | None = None) -> Check:
    """The quantization in effect (``model.quantization`` resolved for this model: a GGUF file's
    stored types under ``auto``) and the weights' bytes it holds, by the planning rule
    (:func:`worker.contract.shapes.weight_bytes`, the figures ``plan`` uses; ``specs``: where the
    model's workers are placed, else placed here). An embedding model's: :mod:`launcher.plan.doctor_embed`."""
    from launcher.plan.doctor_embed import quantization_row
    from launcher.plan.plan import make_plan

    name = "quantization"
    if shape is None:
        return Check(name, "skip", "no model config to size the weights with")
    if shape.embed is not None:
        return Check(name, *quantization_row(cfg, inv, shape, specs))
    s = make_plan(cfg, inv, shape, specs=specs).sizing
    fmt = s.fmt
    detail = (
        f"model.quantization: {cfg.model.quantization} → {fmt.describe(shape.tie_word_embeddings)}; compute dtype {s.dtype}; weights "
        f"{s.weights / GiB:.2f} GiB = {s.held.linear / GiB:.2f} GiB linear layers + {s.held.replicated / GiB:.2f} "
        "GiB embeddings, LM head and norms (planned bytes at rest; the worker reports the memory it measures)"
    )
    if fmt.problem:
        return Check(name, "warn", f"{detail}. {fmt.problem}", "set model.quantization: none, int8 or int4")
    return Check(name, "ok", detail)


def deployment_checks(cfg: DeployConfig, inv: Inventory, shape) -> list[Check]:
    """Placement of the configured workers and whether they fit (the plan; an embedding model's
    as ``plan`` sizes it: weights and one step's activations, no KV cache)."""
    from launcher.plan.plan import make_plan, summary

    try:
        specs = place(cfg.workers, inv)
    except PlacementError as exc:
        return [Check("placement", "fail", str(exc), "see the message; `llamadeploy plan` shows what fits")]
    rows = [Check("placement", "ok", f"{len(specs)} worker(s): {', '.join(s.label for s in specs)}")]
    if shape is None:
        return [*rows, Check("memory plan", "skip", "no model config to plan with")]
    plan = make_plan(cfg, inv, shape, specs=specs)
    if plan.errors:
        rows.append(Check("memory plan", "fail", " ".join(plan.errors), "run `llamadeploy plan` for the table"))
    elif plan.warnings:
        rows.append(Check("memory plan", "warn", " ".join(plan.warnings)))
    elif shape.embed is not None:
        rows.append(Check("memory plan", "ok", summary(plan)))
    else:
        rows.append(
            Check(
                "memory plan",
                "ok",
                f"{plan.sizing.label}: every worker fits "
                f"{min(f.seqs for f in plan.fits)}+ sequences of {plan.sizing.max_model_len} tokens",
            )
        )
    return rows


def port_checks(cfg: DeployConfig) -> list[Check]:
    """One row per listening address: free, held by this same deployment (its router answers
    with this file's :func:`~router.settings.deployment_id`: ``ok``), or held by something else."""
    from launcher.plan.ports import port_problems

    rows = []
    for host, port, key, problem in port_problems(cfg):
        if problem and held_by_this_deployment(cfg, host, port):
            rows.append(Check(key, "ok", f"{host}:{port} is in use by this deployment (its router answers there)"))
            continue
        rows.append(
            Check(
                key,
                "fail" if problem else "ok",
                problem or f"{host}:{port} is free",
                "stop what listens there or choose another port" if problem else "",
            )
        )
    return rows


def held_by_this_deployment(cfg: DeployConfig, host: str, port: int) -> bool:
    """A llamadeploy router listens on ``host:port`` and answers ``/health/live`` with the id of
    the deployment ``cfg`` describes."""
    import httpx

    from router.settings import connect_host, deployment_id

    headers = {"Authorization": f"Bearer {cfg.router.admin_token}"} if cfg.router.admin_token else {}
    try:
        r = httpx.get(f"http://{connect_host(host)}:{port}/health/live", timeout=2.0, headers=headers)
        said = r.json().get("deployment") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    return said == deployment_id(cfg.router, [one.name for one in cfg.served()])


def run_checks(cfg: DeployConfig, inv: Inventory) -> list[Check]:
    """Every check, in the order a person would debug them."""
    rows = [python_check()]
    driver, driver_cuda = driver_check()
    torch_rows, torch_cuda = torch_checks(bool(inv.gpus) or inv.cuda_without_nvml > 0)
    kernel_ran = any(r.name == "CUDA works" and r.status == "ok" for r in torch_rows)
    rows += [
        *torch_rows,
        driver,
        cuda_compat(torch_cuda, driver_cuda, kernel_ran),
        *arch_checks(inv.gpus, torch_arch_list()),
        visibility_check(inv),
        *gpu_checks(inv),
        interconnect_check(cfg, inv),
    ]
    rows += library_checks()
    if len(cfg.served()) == 1:
        model, shape = model_check(cfg.model)
        rows += [model, dtype_check(cfg, inv), quantization_check(cfg, inv, shape), kernels_check(cfg, inv, shape)]
        rows += deployment_checks(cfg, inv, shape)
    else:
        rows += models_checks(cfg, inv)
    return [*rows, *port_checks(cfg)]


def models_checks(cfg: DeployConfig, inv: Inventory) -> list[Check]:
    """A deployment of several models: the placement of them all (packed as ``up`` packs them),
    then each model's rows (files, dtype, quantization, kernels, memory plan) on the devices its
    own workers are placed on, every row named ``'<served name>': <check>`` and grouped by model."""
    from launcher.plan.packing import place_models
    from launcher.plan.several import plan_models

    served = cfg.served()
    names = [one.name for one in served]
    try:
        specs = place_models([one.workers for one in served], inv, names)
    except PlacementError as exc:
        return [Check("placement", "fail", str(exc), "see the message; `llamadeploy plan` shows what fits")]
    rows = [Check("placement", "ok", f"{len(specs)} worker(s): {', '.join(s.label for s in specs)}")]
    shapes = []
    for k, name in enumerate(names):
        one, mine = cfg.for_model(k), [s for s in specs if s.model == k]
        model, shape = model_check(one.model)
        shapes.append(shape)
        found = [model, dtype_check(one, inv, mine), quantization_check(one, inv, shape, mine)]
        found.append(kernels_check(one, inv, shape, mine))
        rows += [Check(f"'{name}': {c.name}", c.status, c.detail, c.fix) for c in found]
    if any(shape is None for shape in shapes):
        return [*rows, Check("memory plan", "skip", "a model's config cannot be read (its row says why)")]
    plan = plan_models(cfg, inv, shapes, specs=specs)
    if plan.errors:
        return [*rows, Check("memory plan", "fail", " ".join(plan.errors), "run `llamadeploy plan` for the table")]
    return [*rows, Check("memory plan", "warn" if plan.warnings else "ok", " ".join(plan.warnings or plan.split()))]


def torch_arch_list() -> list[str] | None:
    """``torch.cuda.get_arch_list()`` (no CUDA initialisation needed); ``None`` without torch."""
    try:
        import torch

        return list(torch.cuda.get_arch_list())
    except Exception:  # noqa: BLE001 -- a broken install: the torch row already says so
        return None


def render(checks: list[Check]) -> Table:
    colors = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
    failed = sum(c.status == "fail" for c in checks)
    skipped = sum(c.status == "skip" for c in checks)
    table = Table(
        title="llamadeploy doctor",
        caption=f"{failed} problem(s), {skipped} check(s) skipped"
        + (" (not checkable on this machine)" if skipped else ""),
    )
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail, c.fix)
    return table
