"""Training (apps layer): the RL recipe and its config, the trainer (TRL's ``GRPOTrainer`` with retrieval
masks, the algorithm table and a critic), the TRL adapter of the agent loop, checkpoints, validation during
training, the warm start and the dry run.

May import: the engine factory and job schemas (``zerosim.engines``, ``zerosim.job_config``), the components
(``simulators``, ``eval``, ``curricula``), ``zerosim.agent`` and ``zerosim.core``. Imported by
``zerosim.experiment`` and ``zerosim.cli``.
"""
