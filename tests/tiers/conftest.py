"""The shared tier's tests here use the redis-server fixtures of tests/remote/."""

from ..remote.conftest import (  # noqa: F401 (fixtures)
    own_redis_server,
    redis_cluster,
    redis_server,
)
