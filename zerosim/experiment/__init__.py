"""``zerosim experiment``: the ZeroSearch question — does a policy trained against the simulator do as well on
real search as one trained on real search? — answered by one command (apps layer).

An orchestrator over the existing jobs (no second implementation of any): it builds each job's config from
one experiment config, runs the jobs as *stages* in order, and writes a report.

- *simulator*: ``simulator collect`` (a real retriever over the training split) → ``simulator train`` (SFT)
  → ``simulator train objective=dpo`` → ``simulator eval`` (quality); skipped when ``simulator.model``
  names a ready simulator;
- *warmstart*: once, shared by every arm;
- *train*: each enabled arm (a set of train overrides on one base recipe) for each seed, same steps and
  trajectories;
- *eval*: every arm's final policy (``method=agent``) on the held-out datasets with each eval engine, plus the
  untrained policy's ``direct`` and ``rag`` baselines;
- *report*: EM / F1 / cover-EM per arm × dataset × engine with 95% bootstrap intervals over questions, and
  paired differences against the reference arm (``report.json``, ``report.md``, ``report.png``).

A stage whose ``stage.json`` holds the same key (:mod:`.keys`) is reused; a killed stage (no ``stage.json``)
runs again — a training stage continues from its last checkpoint — and a changed input re-runs that stage and
everything downstream of it. Each stage records its wall time and how much of the CPU other processes took
meanwhile; only stages timed on a quiet machine teach the dry run's estimates. The MLflow parent run of the
experiment holds every stage's run as a nested run.

The package, in the order a reader follows it: ``config`` (the experiment's settings) → ``kinds`` (what a
stage is; the one table of stage kinds: job, schema, outputs, estimate) → ``keys`` (stage keys and reuse) →
``stages`` (the stage graph) → ``estimates`` → ``run`` (dry run and run) → ``report`` (statistics, tables,
plot).

May import: ``zerosim.training``, ``zerosim.job_config``, ``zerosim.engines``, the components, ``zerosim.agent``
and ``zerosim.core``. Imported by ``zerosim.cli`` only.
"""

from zerosim.experiment.config import ExperimentConfig, load_experiment
from zerosim.experiment.run import ExperimentResult, plan_rows, run_experiment
from zerosim.experiment.stages import build_stages

__all__ = [
    "ExperimentConfig",
    "ExperimentResult",
    "build_stages",
    "load_experiment",
    "plan_rows",
    "run_experiment",
]
