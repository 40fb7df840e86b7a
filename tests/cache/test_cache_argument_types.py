"""Put's score and the id of every single-id call, held to docs/errors.md.

A score that is not a real number was pybind11's bare RuntimeError ("Unable to cast Python
instance...") in put, but TypeError in put_many and update_scores; an id beyond int64 was
TypeError in put/remove/contains/view/get_into but IndexError in get. Both refused calls must
leave the cached value as it was.
"""
import numpy as np
import pytest


@pytest.mark.parametrize("policy", ["importance", "lru", "fifo", "static"])
def test_a_score_that_is_not_a_number_is_a_type_error(cache_factory, policy):
    c = cache_factory(10, policy=policy)
    assert c.put(0, b"old", score=1.0)
    for bad in ("0.5", 10**400, 1 + 2j, [0.5], b"1", object()):
        with pytest.raises(TypeError, match="score must be a real number"):
            c.put(0, b"new", score=bad)
        # in a batch, [[0.5]] is a 2-D array of numbers: a shape error
        with pytest.raises(ValueError if isinstance(bad, list) else TypeError):
            c.put_many([0], [b"new"], scores=[bad])
        with pytest.raises(ValueError if isinstance(bad, list) else TypeError):
            c.update_scores([0], [bad])
        assert c.get(0) == b"old"
    # real numbers of any Python or numpy type are still scores
    for good in (2, 2.5, np.float32(3), np.float64(4), np.int64(5)):
        c.put(1, b"v", score=good)
    c.check()


@pytest.mark.parametrize("policy", ["importance", "lru", "fifo", "static"])
def test_ids_beyond_int64_are_index_errors_everywhere(cache_factory, policy):
    c = cache_factory(10, policy=policy)
    c.put(3, b"keep")
    for big in (2**63, 2**64, -2**63 - 1, 10**30):
        calls = {
            "get": lambda: c.get(big), "put": lambda: c.put(big, b"x"),
            "remove": lambda: c.remove(big), "contains": lambda: c.contains(big),
            "view": lambda: c.view(big), "get_into": lambda: c.get_into(big, bytearray(8)),
            "get_many": lambda: c.get_many([big]), "put_many": lambda: c.put_many([big], [b"x"]),
        }
        for name, call in calls.items():
            with pytest.raises(IndexError, match="out of range"):
                call()
    for not_int in (1.5, "3", None, [3]):
        for call in (lambda: c.get(not_int), lambda: c.put(not_int, b"x"),
                     lambda: c.remove(not_int), lambda: c.contains(not_int),
                     lambda: c.view(not_int), lambda: c.get_into(not_int, bytearray(8))):
            with pytest.raises(TypeError, match="integers"):
                call()
    assert c.get(3) == b"keep" and c.contains(np.int64(3)) and c.get_into(np.uint8(3), bytearray(8)) == 4
    c.check()
