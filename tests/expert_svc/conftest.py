from tests.expert_svc.fixtures import loop, moe_dir  # noqa: F401  (pytest fixtures)
