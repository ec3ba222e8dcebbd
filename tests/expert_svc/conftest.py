from tests.fixtures.expert_servers import loop  # noqa: F401  (a pytest fixture)
