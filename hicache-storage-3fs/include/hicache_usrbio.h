/*
 * The part of 3FS's USRBIO C API (the library libhf3fs_api_shared.so, header hf3fs_usrbio.h) that hicache calls,
 * declared from its public description. `cargo xtask bindgen` turns this file into src/sys.rs.
 *
 * Conventions of the API: functions return 0 or a count for success and -errno for an error (hf3fs_reg_fd returns a
 * positive errno); structures are allocated by the caller and filled by the library.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Shared memory that reads land in and writes come from (3FS's agent maps it). */
struct hf3fs_iov {
  uint8_t *base;
  void *iovh;
  char id[16];
  char mount_point[256];
  size_t size;
  size_t block_size;
  int numa;
};

/* A ring of I/O requests, for reads or for writes. */
struct hf3fs_ior {
  struct hf3fs_iov iov;
  void *iorh;
  char mount_point[256];
  bool for_read;
  int io_depth;
  int priority;
  int timeout;
  uint64_t flags;
};

/* One completed request: its index, bytes moved or -errno, and the caller's pointer. */
struct hf3fs_cqe {
  int32_t index;
  int32_t reserved;
  int64_t result;
  const void *userdata;
};

int hf3fs_extract_mount_point(char *hf3fs_mount_point, int size, const char *path);
int hf3fs_iovcreate(struct hf3fs_iov *iov, const char *hf3fs_mount_point, size_t size, size_t block_size, int numa);
int hf3fs_iovwrap(struct hf3fs_iov *iov, void *base, const uint8_t id[16], const char *hf3fs_mount_point, size_t size,
                  size_t block_size, int numa);
void hf3fs_iovdestroy(struct hf3fs_iov *iov);
int hf3fs_iorcreate4(struct hf3fs_ior *ior, const char *hf3fs_mount_point, int entries, bool for_read, int io_depth,
                     int timeout, int numa, uint64_t flags);
void hf3fs_iordestroy(struct hf3fs_ior *ior);
int hf3fs_reg_fd(int fd, uint64_t flags);
void hf3fs_dereg_fd(int fd);
int hf3fs_prep_io(const struct hf3fs_ior *ior, const struct hf3fs_iov *iov, bool read, void *ptr, int fd, size_t off,
                  uint64_t len, const void *userdata);
int hf3fs_submit_ios(const struct hf3fs_ior *ior);
int hf3fs_wait_for_ios(const struct hf3fs_ior *ior, struct hf3fs_cqe *cqes, int cqec, int min_results,
                       const struct timespec *abs_timeout);
