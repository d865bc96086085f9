"""The shared tier's tests here use the redis-server fixtures of tests/remote/."""

from ..remote.conftest import own_redis_server, redis_server  # noqa: F401 (fixtures)
