"""Which arms each study trains, and the runs (arm x seed) that makes; one sweep trains the union."""

from __future__ import annotations

from openflash.config import FlashConfig
from openflash.experiments.arms import all_full_config, engram_config, moe_config
from openflash.experiments.runs import RunSpec, StudyData
from openflash.experiments.scale import Scale

RHOS = (0.125, 0.25, 0.375, 0.5)  # shares of the routed experts moved to Engram (allocation study)
ENGRAM_RHO = 0.25  # the Engram arm of engram-vs-moe, depth-probe and replay: the paper's optimum region
ENGRAM_ARM = f"engram-rho{ENGRAM_RHO:g}"

STUDY_NAMES = ("engram-vs-moe", "allocation", "depth-probe", "reuse", "replay", "offload")
STUDY_ARMS: dict[str, tuple[str, ...]] = {
    "engram-vs-moe": ("moe", ENGRAM_ARM),
    "allocation": ("moe", *(f"engram-rho{r:g}" for r in RHOS)),
    "depth-probe": ("moe", ENGRAM_ARM),
    "reuse": ("moe", "all-full"),
    "replay": (ENGRAM_ARM,),
    "offload": (),  # a throughput A/B of the Engram arm's shape with large tables; trains nothing
}


def arm_config(name: str, scale: Scale, vocab_size: int) -> FlashConfig:
    if name == "moe":
        return moe_config(scale, vocab_size)
    if name == "all-full":
        return all_full_config(scale, vocab_size)
    if name.startswith("engram-rho"):
        return engram_config(scale, vocab_size, float(name.removeprefix("engram-rho")))
    raise KeyError(name)


def run_specs(studies: list[str], scale: Scale, data: StudyData) -> dict[str, list[RunSpec]]:
    """arm -> its runs (seeds 0..scale.seeds-1), for every arm the studies use (shared arms listed once)."""
    arms = dict.fromkeys(a for s in studies for a in STUDY_ARMS[s])
    configs = {arm: arm_config(arm, scale, data.vocab_size) for arm in arms}  # sized once (a prime search each)
    return {arm: [RunSpec(arm, seed, configs[arm], scale, data) for seed in range(scale.seeds)] for arm in arms}
