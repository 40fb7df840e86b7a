// A POSIX shared-memory segment: create (exclusive, mode 0600, space reserved up front), attach,
// unlink. Knows nothing of what lives inside it.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace shadecache {

class Segment {
 public:
  // Creates "/shadecache.<name>" of `size` bytes (O_EXCL, 0600: this user's alone; shm_open adds
  // O_NOFOLLOW). Fails with kExists if the name is taken (naming the owner when another user took it) and with
  // kCapacity (before creating anything) if /dev/shm lacks the room. The pages are reserved with
  // posix_fallocate, so a full tmpfs is an error here and never a SIGBUS on first touch later.
  // `before_reserve(fd)` runs once the file has its size and before the reservation (which takes
  // seconds for gigabytes): the caller writes with it what an attacher may read meanwhile.
  static Segment create(const std::string& name, size_t size,
                        const std::function<void(int fd)>& before_reserve = nullptr);
  // Maps an existing segment read-write. kNotFound if there is none; PermissionError (kOs, EACCES)
  // naming the owner when it is not this user's own or is open to group or others (checked on the
  // descriptor before anything is mapped). A size of 0 means its creator has not sized it yet:
  // attach waits up to 2 s for that (kLayout after).
  static Segment attach(const std::string& name);
  // Removes the name (mappings stay valid until unmapped). Returns false if it did not exist;
  // PermissionError when another user owns it.
  static bool unlink(const std::string& name);
  // Names (without prefix) of every shadecache segment on this node.
  static std::vector<std::string> list();
  // The file system path of a segment, for messages: /dev/shm/shadecache.<name>.
  static std::string path(const std::string& name);
  static void validate_name(const std::string& name);

  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { unmap(); }

  void unmap();
  char* base() const { return base_; }
  size_t size() const { return size_; }
  bool mapped() const { return base_ != nullptr; }

 private:
  static Segment map(int fd, size_t size, const std::string& name);  // MAP_SHARED, read-write

  char* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace shadecache
