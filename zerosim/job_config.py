"""The schemas of the component commands that search with an engine the app builds: ``zerosim eval`` and
``zerosim simulator collect``. Each is its component's own fields (``eval.config.HarnessConfig``,
``simulators.config.CollectConfig``) plus ``search`` (:class:`zerosim.engines.SearchConfig`), which composes
parts of every component and so lives with the app's engine factory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eval.config import HarnessConfig
from simulators.config import CollectConfig
from zerosim.core.tracking import refuse_log_model
from zerosim.engines import EngineName, SearchConfig


@dataclass
class EvalConfig(HarnessConfig):
    """``zerosim eval``: a policy answers QA datasets with one method and one search engine."""

    search: SearchConfig = field(default_factory=lambda: SearchConfig(engine=EngineName.bm25))

    def validate(self, prefix: str) -> None:
        """An evaluation trains nothing, so it has no model of its own to log (``tracking.log_model``); a
        read_page tool needs an engine with pages."""
        from zerosim.engines import check_pages

        check_pages(self.search, self.rollout, prefix)
        refuse_log_model(
            self.tracking,
            prefix,
            job="an evaluation",
            trainer="the training job (zerosim train, zerosim simulator train) that writes the policy",
        )


@dataclass
class SimulatorCollectConfig(CollectConfig):
    """``zerosim simulator collect``: queries + real-retriever documents labelled useful/noisy -> SFT jsonl."""

    search: SearchConfig = field(default_factory=lambda: SearchConfig(engine=EngineName.bm25))
