"""Agent layer: the search protocol (tags, prompt, the one tag parser), the multi-turn rollout loop and the
rewards, with their settings (``RolloutConfig``, ``RewardConfig``) beside them. No trainer, no TRL.

May import: ``zerosim.core`` and third-party libraries. Imported by the components (``simulators``,
``eval``, ``curricula``) and the apps (``zerosim.engines``, ``zerosim.job_config``, ``zerosim.training``,
``zerosim.experiment``, ``zerosim.cli``).
"""
