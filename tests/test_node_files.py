"""Files on the node have one owner: the cache segment, the order board, the tier status file and
the SSD tier's directory, each attacked by another real user (uid 65534) before or beside a victim
(root, and a second ordinary uid where a permission must bite). Those tests run as root and skip
otherwise; the tests of one user's own files run as anyone."""
import json
import os
import stat
import uuid

import pytest

import shadecache as sc
from shadecache import _core
from shadecache import shm
from shadecache.cache import node as cache_mod
from shadecache.lookahead import board as order
from shadecache import status as tier_status
from shadecache.ssd.layout import slot_bytes

from other_user import ATTACKER, VICTIM, PrivateDir, needs_root, run_as, unlink_quietly

OWNER = r"uid 65534 \(nobody\)"   # how a refusal names the attacker


def _name():
    return f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _seg_path(name):
    return _core.CacheCore.path(name)


@pytest.fixture
def name():
    """A unique cache name; everything any user made under it in /dev/shm is removed after."""
    n = _name()
    yield n
    for p in (_seg_path(n), shm.board_path(n), shm.job_board_path(n, 0), tier_status.path_of(n)):
        unlink_quietly(p)


def _attacker_plants_segment(name, mode):
    """As the attacker: the cache `name` created first, a poisoned sample 0, the given mode."""
    c = sc.Cache.create(name, num_samples=8, capacity_bytes=1 << 20, policy="lru")
    c.put(0, b"POISON from the attacker")
    os.chmod(_seg_path(name), mode)
    c.close()
    return os.stat(_seg_path(name)).st_uid


# ---- the cache segment ----------------------------------------------------------------------------
@needs_root
def test_cache_segment_made_first_by_another_user_is_refused_never_attached(name):
    """A segment another user made first under the victim's name (open to everyone) is refused by
    attach, create_or_attach and create, for a root victim and an ordinary one, with an error
    naming its owner; the attacker's sample is never returned and nothing of the victim's gets in."""
    assert run_as(ATTACKER, _attacker_plants_segment, name, 0o666) == ATTACKER
    with pytest.raises(PermissionError, match=OWNER):
        sc.Cache.create_or_attach(name, 8, 1 << 20, policy="lru")
    with pytest.raises(PermissionError, match=OWNER):
        sc.Cache.attach(name)
    with pytest.raises(FileExistsError, match=OWNER):
        sc.Cache.create(name, 8, 1 << 20)

    def victim():
        try:
            c = sc.Cache.create_or_attach(name, 8, 1 << 20, policy="lru")
        except PermissionError as e:
            return ("refused", str(e))
        got = c.get(0)
        c.put(1, b"the victim's sample")
        return ("attached", got)

    outcome, detail = run_as(VICTIM, victim)
    assert outcome == "refused", f"an ordinary victim attached the attacker's segment and read {detail!r}"
    assert "uid 65534 (nobody)" in detail and "uid 65533" in detail

    def attacker_reads():
        with open(_seg_path(name), "rb") as f:
            return b"the victim's sample" in f.read()

    assert run_as(ATTACKER, attacker_reads) is False


@needs_root
def test_cache_segment_of_another_user_closed_to_this_one_names_its_owner(name):
    """A 0600 segment of another user cannot even be opened by an ordinary victim: the error says
    whose it is (not only "Permission denied")."""
    run_as(ATTACKER, _attacker_plants_segment, name, 0o600)

    def victim():
        try:
            sc.Cache.create_or_attach(name, 8, 1 << 20, policy="lru")
        except PermissionError as e:
            return str(e)
        return None

    msg = run_as(VICTIM, victim)
    assert msg is not None and "uid 65534 (nobody)" in msg and name in msg


def test_own_cache_segment_open_to_group_or_others_is_refused(name):
    c = sc.Cache.create(name, 8, 1 << 20, policy="lru")
    try:
        os.chmod(_seg_path(name), 0o644)
        with pytest.raises(PermissionError, match="0644"):
            sc.Cache.attach(name)
        os.chmod(_seg_path(name), 0o600)
        sc.Cache.attach(name).close()
    finally:
        c.close()
        c.unlink()


@needs_root
def test_rm_and_gc_leave_another_users_files_alone(name):
    """gc and rm remove only this user's files: another user's dead segment, orphan order board
    and stale tier status file stay (and rm says whose the segment is)."""
    def attacker():
        _attacker_plants_segment(name, 0o600)          # its creator (this process) dies next
        order.OrderBoard.create(name + "-noboard", 4).close()
        tier_status.write(name, {"pid": 2 ** 22 + 7, "address": "203.0.113.9:6666"})
        os.symlink("/etc/passwd", tier_status.path_of(name + "-link"))

    run_as(ATTACKER, attacker)
    board, link = shm.board_path(name + "-noboard"), tier_status.path_of(name + "-link")
    job = shm.job_board_path(name + "-noboard", 0)      # the job the attacker registered on it
    try:
        removed = cache_mod.gc()
        assert name not in removed and os.path.exists(_seg_path(name))
        assert os.path.exists(board) and os.path.exists(tier_status.path_of(name))
        assert os.path.exists(job)
        assert os.path.lexists(link)
        with pytest.raises(PermissionError, match=OWNER):
            cache_mod.remove(name)
        assert os.path.exists(_seg_path(name))
    finally:
        unlink_quietly(board)
        unlink_quietly(job)
        unlink_quietly(link)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@needs_root
def test_a_directory_or_fifo_planted_at_the_node_files_names_is_refused_naming_its_owner(name, kind):
    """Another user plants a directory or a FIFO (not a file) at the segment's, the board's and
    the tier status file's names: every refusal names the owner and what was found, whichever
    check (the kernel's open, or the regular-file check on the descriptor) catches it."""
    paths = (_seg_path(name), shm.board_path(name), tier_status.path_of(name))

    def plant():
        for p in paths:
            os.mkdir(p, 0o777) if kind == "directory" else os.mkfifo(p, 0o666)

    found = "a directory" if kind == "directory" else "a FIFO"
    run_as(ATTACKER, plant)
    try:
        for call in (lambda: sc.Cache.create_or_attach(name, 8, 1 << 20),
                     lambda: sc.Cache.attach(name),
                     lambda: order.OrderBoard.attach(name),
                     lambda: tier_status.write(name, {"pid": os.getpid(), "address": "127.0.0.1:1"})):
            with pytest.raises(PermissionError, match=OWNER) as refused:
                call()
            assert found in str(refused.value)
        with pytest.raises(FileExistsError, match=OWNER):
            sc.Cache.create(name, 8, 1 << 20)
        with pytest.warns(RuntimeWarning, match=OWNER):
            assert tier_status.read(name) is None
        assert all(os.lstat(p).st_uid == ATTACKER for p in paths)
    finally:
        for p in paths:
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            else:
                unlink_quietly(p)


def test_own_non_file_at_a_board_or_status_name_is_refused_saying_what_it_is(name):
    """This user's own directory where a board or a status file belongs: refused (never replaced
    by the status write), the message saying what is there."""
    os.mkdir(tier_status.path_of(name), 0o700)
    os.mkfifo(shm.board_path(name), 0o600)
    try:
        with pytest.raises(PermissionError, match="a directory of this user"):
            tier_status.write(name, {"pid": os.getpid()})
        assert os.path.isdir(tier_status.path_of(name))
        with pytest.raises(PermissionError, match="a FIFO of this user"):
            order.OrderBoard.attach(name)
    finally:
        os.rmdir(tier_status.path_of(name))


@needs_root
def test_rm_of_several_names_reports_another_users_and_removes_the_rest(name, capsys):
    """`shadecache rm THEIRS MINE`: THEIRS is reported with its owner and left, MINE is still
    removed, and the exit status says not everything was."""
    from shadecache.cli import main

    mine = name + "-mine"
    run_as(ATTACKER, lambda: sc.Cache.create(name, 8, 1 << 20, persist=True).close())
    sc.Cache.create(mine, 8, 1 << 20, persist=True).close()
    try:
        assert main(["rm", name, mine]) == 1
        out, err = capsys.readouterr()
        assert f"removed {mine}" in out and "uid 65534 (nobody)" in err and name in err
        assert not os.path.exists(_seg_path(mine))
        assert os.lstat(_seg_path(name)).st_uid == ATTACKER
    finally:
        unlink_quietly(_seg_path(mine))


def _dead_segment(name):
    """A segment of this user whose creator is gone: made in a child that exits at once
    (os._exit: its exit handler would remove it)."""
    pid = os.fork()
    if pid == 0:
        try:
            sc.Cache.create(name, 8, 1 << 20).close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(_seg_path(name))


@needs_root
def test_gc_skips_a_name_that_changes_owner_mid_sweep_and_goes_on(name, monkeypatch):
    """Between gc's look at a dead segment of ours and its remove, the name changes hands
    (another gc of ours removes it, another user makes a segment under it). gc leaves theirs and
    still removes the later dead segment. The interleaving is forced by running those two real
    steps inside describe(), which gc calls between the look and the remove."""
    later = name + "-z"   # sorts after `name`
    for n in (name, later):
        _dead_segment(n)
    real_describe = cache_mod.describe

    def describe_then_name_changes_hands(n):
        d = real_describe(n)
        if n == name:
            _core.CacheCore.unlink(n)
            run_as(ATTACKER, lambda: sc.Cache.create(n, 8, 1 << 20, persist=True).close())
        return d

    monkeypatch.setattr(cache_mod, "describe", describe_then_name_changes_hands)
    try:
        removed = cache_mod.gc()
        assert later in removed and name not in removed
        assert not os.path.exists(_seg_path(later))
        assert os.lstat(_seg_path(name)).st_uid == ATTACKER
    finally:
        unlink_quietly(_seg_path(later))


# ---- the order board ------------------------------------------------------------------------------
@needs_root
def test_order_board_made_first_by_another_user_is_refused(name):
    """A board another user made first for the victim's cache (with an order of its choosing) is
    never attached: not by a node's (or a sampler's) link, not by attach, and create says whose
    it is."""
    def attacker():
        b = order.OrderBoard.create(name, 16)
        b.orders.publish(0, 0, list(range(15, -1, -1)))
        os.chmod(shm.board_path(name), 0o666)      # the node's file, and the job's
        os.chmod(b.path, 0o666)
        b.close()

    run_as(ATTACKER, attacker)
    c = sc.Cache.create(name, 16, 1 << 20, policy="clairvoyant")
    try:
        with pytest.raises(PermissionError, match=OWNER):
            order.BoardLink(c.name).get()            # what a node or a sampler of the cache looks for
        with pytest.raises(PermissionError, match=OWNER):
            order.OrderBoard.attach(name)
        with pytest.raises(FileExistsError, match=OWNER):
            order.OrderBoard.create(name, 16)
    finally:
        c.close()
        c.unlink()

    def victim():
        try:
            b = order.OrderBoard.attach(name)
        except PermissionError as e:
            return ("refused", str(e))
        return ("attached", b.orders.snapshot(0))

    outcome, detail = run_as(VICTIM, victim)
    assert outcome == "refused" and "uid 65534 (nobody)" in detail, detail


# ---- the tier status file -------------------------------------------------------------------------
PLANTED = "203.0.113.9:6666"


def _attacker_plants_status(name):
    with open(tier_status.path_of(name), "w") as f:
        json.dump({"pid": 1, "address": PLANTED, "peers": []}, f)   # pid 1: alive, so "not stale"
    os.chmod(tier_status.path_of(name), 0o644)


@needs_root
def test_tier_status_planted_by_another_user_never_shows_as_live(name, capsys):
    """A status file planted for the victim's cache (naming a live pid and the attacker's address)
    is refused: stats() and `shadecache ls` never show it, for a root victim and an ordinary one."""
    theirs = name + "-u"   # the ordinary victim's cache
    run_as(ATTACKER, _attacker_plants_status, name)
    run_as(ATTACKER, _attacker_plants_status, theirs)
    c = sc.Cache.create(name, 8, 1 << 20)
    try:
        with pytest.warns(RuntimeWarning, match=OWNER):
            s = c.stats()
        assert "tiers" not in s, f"stats() shows a planted status: {s.get('tiers')}"
        from shadecache.cli import cache as cache_cli
        with pytest.warns(RuntimeWarning, match=OWNER):
            cache_cli.cmd_ls(None)
        assert PLANTED not in capsys.readouterr().out

        def victim():
            import warnings
            mine = sc.Cache.create(theirs, 8, 1 << 20)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return mine.stats().get("tiers")
            finally:
                mine.close()
                mine.unlink()

        assert run_as(VICTIM, victim) is None
    finally:
        c.close()
        c.unlink()
        unlink_quietly(tier_status.path_of(theirs))


def test_tier_status_file_is_made_0600_and_leaves_no_temporary_file(name):
    tier_status.write(name, {"pid": os.getpid(), "address": "127.0.0.1:1"})
    st = os.lstat(tier_status.path_of(name))
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert tier_status.read(name)["address"] == "127.0.0.1:1"
    assert [e for e in os.listdir(shm.SHM_DIR) if e.startswith(shm.STATUS_PREFIX + name)] == \
        [os.path.basename(tier_status.path_of(name))]


@needs_root
def test_tier_status_write_over_another_users_file_is_refused_cleanly(name):
    """An ordinary victim's server cannot replace a status file another user planted (the sticky
    /dev/shm): write says whose it is and leaves no temporary file behind."""
    run_as(ATTACKER, _attacker_plants_status, name)

    def victim():
        try:
            tier_status.write(name, {"pid": os.getpid(), "address": "127.0.0.1:1"})
        except PermissionError as e:
            return str(e)
        return None

    msg = run_as(VICTIM, victim)
    assert msg is not None and "uid 65534 (nobody)" in msg
    left = [e for e in os.listdir(shm.SHM_DIR) if e.startswith(shm.STATUS_PREFIX + name)]
    assert left == [os.path.basename(tier_status.path_of(name))], left


@needs_root
def test_root_status_write_leaves_another_users_file_and_the_publisher_goes_on(name):
    """Root passes the sticky /dev/shm's check, so the kernel lets a root server rename over a
    status file another user planted: the write refuses instead, naming the owner, and leaves
    their file as it is (same inode, same bytes) with no temporary file. The server's publishing
    thread goes on, and publishes its own status once the name is free."""
    import threading
    import time

    from shadecache.peer import new_secret
    from shadecache.peer.server import PeerService

    run_as(ATTACKER, _attacker_plants_status, name)
    planted = os.lstat(tier_status.path_of(name))
    with open(tier_status.path_of(name), "rb") as f:
        planted_bytes = f.read()
    with pytest.raises(PermissionError, match=OWNER):
        tier_status.write(name, {"pid": os.getpid(), "address": "127.0.0.1:1"})
    now = os.lstat(tier_status.path_of(name))
    assert (now.st_ino, now.st_uid) == (planted.st_ino, ATTACKER)
    with open(tier_status.path_of(name), "rb") as f:
        assert f.read() == planted_bytes
    assert [e for e in os.listdir(shm.SHM_DIR) if e.startswith(shm.STATUS_PREFIX + name)] == \
        [os.path.basename(tier_status.path_of(name))]

    c = sc.Cache.create(name, 8, 1 << 20)
    service = PeerService(sc.Node(None, c, read_ahead=False), secret=new_secret())
    publisher = threading.Thread(target=service.publish_forever, args=(0.02,), daemon=True)
    try:
        publisher.start()
        time.sleep(0.2)
        assert publisher.is_alive() and os.lstat(tier_status.path_of(name)).st_ino == planted.st_ino
        unlink_quietly(tier_status.path_of(name))   # the other user (or root) removes their file
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            mine = tier_status.read(name)
            if mine is not None:
                break
            time.sleep(0.02)
        assert mine is not None and mine["address"] == service.address and mine["pid"] == os.getpid()
        assert os.lstat(tier_status.path_of(name)).st_uid == os.geteuid()
    finally:
        service.close()
        publisher.join(5)
        c.close()
        c.unlink()


# ---- the SSD tier ---------------------------------------------------------------------------------
@pytest.fixture
def shared_tmp():
    """A directory in /tmp (sticky, world-writable) for the attacker's tiers; removed after."""
    d = PrivateDir(0, prefix="shadecache-shared-")
    os.chmod(d.path, 0o1777)
    yield d.path
    d.cleanup()


@needs_root
def test_ssd_tier_in_a_directory_another_user_made_is_refused(shared_tmp):
    """The attacker prepares a tier directory (bound to the victim's data set, holding its own
    bytes); the victim naming that path gets an error naming the owner, never an SSD hit."""
    path = os.path.join(shared_tmp, "tier")

    def attacker():
        t = sc.SSDTier(path, 1 << 20, fingerprint="victim-data-set")
        t.put_many(range(4), [b"POISON %d" % i for i in range(4)])
        t.flush()
        t.close()
        os.chmod(path, 0o755)

    run_as(ATTACKER, attacker)
    with pytest.raises(PermissionError, match=OWNER):
        t = sc.SSDTier(path, 1 << 20, fingerprint="victim-data-set")
        pytest.fail(f"the victim opened the attacker's tier and read {t.get_many(range(4))}")


@pytest.mark.parametrize("made_by", [ATTACKER, VICTIM], ids=["attackers-dir", "victims-open-dir"])
@needs_root
def test_ssd_tier_refuses_a_directory_writable_by_others_and_its_planted_link(shared_tmp, made_by):
    """A world-writable tier directory (the attacker's, or the victim's own left open) with a
    planted slots-*.dat link to a 0600 file of the victim: refused, naming the owner or the mode,
    and the victim's file is untouched (before, the tier wrote the sample into it)."""
    victim_dir = PrivateDir(VICTIM)
    secret = os.path.join(victim_dir.path, "secret")
    path = os.path.join(shared_tmp, "tier")
    value = b"v" * 100
    try:
        def victim_setup():
            with open(secret, "wb") as f:
                f.write(b"the victim's 0600 file")
            os.chmod(secret, 0o600)

        run_as(VICTIM, victim_setup)

        def make_dir():
            os.mkdir(path)
            os.chmod(path, 0o777)

        def attacker():
            os.symlink(secret, os.path.join(path, f"slots-{slot_bytes(len(value))}.dat"))

        run_as(made_by, make_dir)
        run_as(ATTACKER, attacker)

        def victim():
            try:
                t = sc.SSDTier(path, 1 << 20)
            except PermissionError as e:
                return ("refused", str(e))
            t.put_many([0], [value])
            t.flush()
            t.close()
            return ("used", None)

        outcome, detail = run_as(VICTIM, victim)
        with open(secret, "rb") as f:
            assert f.read() == b"the victim's 0600 file", "the tier wrote through the planted link"
        why = "uid 65534 (nobody)" if made_by == ATTACKER else "writable by group or others (mode 0777)"
        assert outcome == "refused" and why in detail, detail
    finally:
        victim_dir.cleanup()


def test_ssd_tier_never_follows_a_link_inside_its_own_directory(tmp_path):
    """Even in the user's own directory, a slot file that is a symbolic link is refused (the write
    is given up), and its target is untouched."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a slot file")
    path = tmp_path / "tier"
    value = b"w" * 100
    t = sc.SSDTier(path, 1 << 20)
    os.symlink(target, path / f"slots-{slot_bytes(len(value))}.dat")
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        t.put_many([0], [value])
        t.flush()
    t.close()
    assert target.read_bytes() == b"not a slot file"


def test_ssd_tier_made_by_its_user_is_0700_with_0600_files(tmp_path):
    path = tmp_path / "tier"
    t = sc.SSDTier(path, 1 << 20, fingerprint="a-data-set")
    t.put_many(range(8), [b"x" * (100 * (i + 1)) for i in range(8)])
    t.flush()
    t.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    modes = {e.name: stat.S_IMODE(e.stat(follow_symlinks=False).st_mode) for e in os.scandir(path)}
    assert {"index", "lock", "fingerprint"} <= set(modes) and any(n.startswith("slots-") for n in modes)
    assert all(m == 0o600 for m in modes.values()), modes


def test_ssd_tier_of_an_older_version_keeps_its_samples_and_is_closed(tmp_path):
    """A tier an older shadecache made (a 0755 directory, 0644 files) opens with its samples: the
    files group and others could only read are made 0600; one they could write is refused."""
    path = tmp_path / "tier"
    t = sc.SSDTier(path, 1 << 20, fingerprint="a-data-set")
    t.put_many(range(4), [b"y" * 300] * 4)
    t.flush()
    t.close()
    os.chmod(path, 0o755)
    for e in os.scandir(path):
        os.chmod(e.path, 0o644)
    t = sc.SSDTier(path, 1 << 20, fingerprint="a-data-set")
    assert t.get_many(range(4)) == [b"y" * 300] * 4
    t.close()
    assert all(stat.S_IMODE(e.stat().st_mode) == 0o600 for e in os.scandir(path))
    os.chmod(path / "index", 0o666)
    with pytest.raises(PermissionError, match="open to group or others"):
        sc.SSDTier(path, 1 << 20, fingerprint="a-data-set").get_many([0])


@pytest.mark.parametrize("suffix", ["/", "/.", "//./"])
@needs_root
def test_ssd_tier_path_ending_in_slash_or_dot_never_follows_a_link(suffix):
    """In a shared scratch directory (world-writable, not sticky: the kernel's protected_symlinks
    does not apply) another user links "tier" to a directory of the victim holding an `index`.
    "scratch/tier" was refused, but "scratch/tier/" and "scratch/tier/." made the kernel follow
    the link, and the tier replaced the victim's index. Every form is refused, naming the link's
    owner, and the victim's directory is untouched."""
    scratch = PrivateDir(0, prefix="shadecache-scratch-")
    os.chmod(scratch.path, 0o777)
    home = PrivateDir(VICTIM)
    theirs = os.path.join(home.path, "git")
    link = os.path.join(scratch.path, "tier")
    try:
        def victim_setup():
            os.mkdir(theirs, 0o700)
            with open(os.path.join(theirs, "index"), "wb") as f:
                f.write(b"DIRC the victim's own index")

        run_as(VICTIM, victim_setup)
        run_as(ATTACKER, lambda: os.symlink(theirs, link))

        def victim(p):
            try:
                t = sc.SSDTier(p, 1 << 20)
            except PermissionError as e:
                return ("refused", str(e))
            t.put_many([0], [b"x" * 100])
            t.flush()
            t.close()
            return ("used", None)

        outcome, detail = run_as(VICTIM, victim, link + suffix)
        assert outcome == "refused" and "symbolic link" in detail and "uid 65534 (nobody)" in detail, detail
        assert os.listdir(theirs) == ["index"]
        with open(os.path.join(theirs, "index"), "rb") as f:
            assert f.read() == b"DIRC the victim's own index"
    finally:
        scratch.cleanup()
        home.cleanup()


def test_ssd_tier_path_with_trailing_slash_or_dot_is_the_directory_itself(tmp_path):
    """"dir/" and "dir/." name the directory "dir" (the tier reports and pickles that path); a
    path ending in ".." is refused as bad input, nothing made."""
    for given in (f"{tmp_path}/tier/", f"{tmp_path}/./tier/.", f"{tmp_path}//tier//"):
        t = sc.SSDTier(given, 1 << 20)
        assert t.path == f"{tmp_path}/tier"
        t.close()
    assert stat.S_IMODE(os.stat(tmp_path / "tier").st_mode) == 0o700
    with pytest.raises(ValueError, match=r"ends in '\.\.'"):
        sc.SSDTier(f"{tmp_path}/other/..", 1 << 20)
    assert not (tmp_path / "other").exists()
