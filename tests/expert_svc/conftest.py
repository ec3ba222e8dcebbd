from tests.fixtures.expert_servers import loop, moe_dir  # noqa: F401  (pytest fixtures)
