// Files on the node belong to the user who runs shadecache (docs/node_files.md). Names in
// /dev/shm are predictable and the directory is shared by every user: another user can make a
// file under our name first. These checks run on the opened descriptor (fstat: no race with the
// path) before a byte of the file is read or mapped. shadecache/node_files.py is the Python side.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>

namespace shadecache {

// "uid 65534 (nobody)"; "uid 1234" for a uid without an account.
std::string user_name(uid_t uid);

// The stat of `fd` (opened from `path`; `what` names it in messages, e.g. "cache 'x'") when it is
// a regular file owned by this process's effective uid with no permission for group or others.
// Otherwise throws PermissionError (kOs, EACCES) naming the owner (whatever kind of file another
// user's is), or the kind or the mode of this user's, and `advice`.
struct stat check_own_file(int fd, const std::string& path, const std::string& what,
                           const std::string& advice);

// Throws for an open of `path` that failed with `err`: when another user owns the entry (lstat,
// for the message only: the kernel refused already), whatever `err` is but ENOENT, the
// PermissionError names them; otherwise the error of `err`.
[[noreturn]] void throw_open_failed(const std::string& call, const std::string& path,
                                    const std::string& what, const std::string& advice, int err);

// Whether the entry `path` (lstat: not what a link names) exists and belongs to another user;
// its owner in *uid. Removing a file takes this look first (gc, rm never remove another user's).
bool owned_by_another(const std::string& path, uid_t* uid);

}  // namespace shadecache
