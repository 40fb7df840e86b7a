"""The caches of a node from the Cache class: Cache.list() and Cache.remove(name), next to a cache's
own remove(i) of one sample."""
import shadecache as sc


def test_list_and_remove_by_name(cache_name):
    assert cache_name not in sc.Cache.list()
    c = sc.Cache.create(cache_name, num_samples=10, capacity_bytes=1 << 20)
    assert cache_name in sc.Cache.list() and sc.Cache.list() == sorted(sc.Cache.list())
    assert c.put(3, b"x" * 100) and c.remove(3) and not c.contains(3)   # on a cache: a sample
    assert sc.Cache.remove(cache_name) is True                          # on the class: the cache
    assert cache_name not in sc.Cache.list() and sc.Cache.remove(cache_name) is False
    assert c.put(4, b"y") and c.get(4) == b"y"     # this process keeps its mapping until it closes
    c.close()
