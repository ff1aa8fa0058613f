// The Metal execution model on one CPU thread, for `python -m mtlqwen.kernels.check_metal --run`.
// Every GPU thread of a threadgroup is a fiber with its own stack (a register-only switch on x86-64,
// ucontext elsewhere: swapcontext's signal-mask syscall made millions of switches slow). A fiber runs
// until it reaches a synchronisation point -- threadgroup_barrier, a SIMD-group function -- or returns;
// the scheduler then completes the SIMD-group functions of each simdgroup among its waiting lanes (lanes
// that returned, or wait elsewhere, are inactive, as under divergence on the GPU), and releases a barrier
// once every thread of the threadgroup waits at that same barrier (one that returned instead, or waits
// at another barrier, is an error: MSL requires them all). Threadgroups run one after
// another, last first (nothing may depend on their order); their threads run highest first in every
// other one. Threadgroup memory is static storage (the Python side rewrites the declarations to call
// tg_note), poisoned with 0xFF before each threadgroup. Device buffers end at a page followed by an
// inaccessible one: a read or write past a buffer's end faults instead of passing silently.
//
// The driver (written by metal_emulator.py) includes this header, the kernel source, and defines
// `pl_thread(const pl::Thread&)`, which calls the kernel with the buffers in `pl::buffers` and the thread's
// attributes; `main` reads the launch from argv[1] and writes every buffer back to argv[2].
#pragma once
#include "metal_shim.h"

#include <cstdio>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

namespace pl {

// ---- fibers: start(f, stack, size, fn) prepares f to run fn on that stack; swap(from, to) ---------------------
#if defined(__x86_64__)
extern "C" void pl_swap(void** save_sp, void* load_sp);
__asm__(R"(
.text
.globl pl_swap
.type pl_swap,@function
pl_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size pl_swap,.-pl_swap
)");
struct Fiber {
  void* sp;
};
inline void fiber_start(Fiber& f, unsigned char* stack, size_t size, void (*fn)()) {
  uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)(top - 72);  // 8 slots popped by pl_swap + a fake return address: fn's entry ABI
  uint32_t csr[2];
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(csr[1]));
  memcpy(&sp[0], csr, 8);
  for (int i = 1; i < 7; ++i) sp[i] = 0;  // r15 r14 r13 r12 rbx rbp
  sp[7] = (uint64_t)(uintptr_t)fn;
  sp[8] = 0;
  f.sp = sp;
}
inline void fiber_swap(Fiber& from, Fiber& to) { pl_swap(&from.sp, to.sp); }
#else
struct Fiber {
  ucontext_t ctx;
};
inline ucontext_t& fiber_proto() {
  static ucontext_t p;
  static bool done = false;
  if (!done) {
    getcontext(&p);
    done = true;
  }
  return p;
}
inline void fiber_start(Fiber& f, unsigned char* stack, size_t size, void (*fn)()) {
  f.ctx = fiber_proto();
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = size;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fn, 0);
}
inline void fiber_swap(Fiber& from, Fiber& to) { swapcontext(&from.ctx, &to.ctx); }
#endif

struct Thread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint3 grid_origin, grid_size;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint threads_per_simdgroup, simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  uint thread_execution_width, quadgroup_index_in_threadgroup, thread_index_in_quadgroup;
  uint quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

struct Buffer {
  unsigned char* data;
  uint64_t nbytes;
  int ndim;
  int shape[8];
  int64_t strides[8];
};

enum State { READY, AT_SIMD, AT_BARRIER, DONE };
enum { MAX_THREADS = 1024, STACK = 256 * 1024, SLOT = 64 };

struct Lane {
  Fiber fiber;
  State state;
  Thread t;
  const void* site;  // where it waits: the collective's combine function, or the barrier's source line
  int size, arg;
  const void* in;
  void* out;
};

Buffer buffers[64];
int n_buffers = 0;

void pl_fail(const char* what, const Thread* t) {
  if (t) {
    fprintf(stderr, "EMULATOR: %s (thread (%u,%u,%u) of threadgroup (%u,%u,%u))\n", what,
            t->thread_position_in_threadgroup.x, t->thread_position_in_threadgroup.y,
            t->thread_position_in_threadgroup.z, t->threadgroup_position_in_grid.x, t->threadgroup_position_in_grid.y,
            t->threadgroup_position_in_grid.z);
  } else {
    fprintf(stderr, "EMULATOR: %s\n", what);
  }
  fflush(stderr);
  _exit(3);
}

namespace rt {
Lane* lanes;
int n_lanes;
Lane* current;
Fiber scheduler;
void (*entry)(const Thread&);
struct Region {
  void* p;
  size_t bytes;
};
Region tg[64];
int n_tg = 0;
size_t tg_bytes = 0;

void wait_here() {
  if (!current) pl_fail("a synchronisation point outside a kernel", nullptr);
  Lane* me = current;
  fiber_swap(me->fiber, scheduler);
}
void trampoline() {
  Lane* me = current;
  entry(me->t);
  me->state = DONE;
  fiber_swap(me->fiber, scheduler);  // never resumed
}
}  // namespace rt

void tg_note(void* p, size_t bytes) {
  for (int i = 0; i < rt::n_tg; ++i) if (rt::tg[i].p == p) return;
  if (rt::n_tg == 64) pl_fail("more than 64 threadgroup variables", nullptr);
  rt::tg[rt::n_tg++] = {p, bytes};
  rt::tg_bytes += bytes;
  memset(p, 0xff, bytes);
}

__attribute__((noinline)) void collective(const void* in, void* out, int size, int arg, Combine combine) {
  Lane* me = rt::current;
  if (!me) pl_fail("a SIMD-group function outside a kernel", nullptr);
  if (size > SLOT) pl_fail("a SIMD-group function on a value wider than 64 bytes", &me->t);
  me->state = AT_SIMD;
  me->site = (const void*)combine;
  me->in = in;
  me->out = out;
  me->size = size;
  me->arg = arg;
  rt::wait_here();
}

void barrier(int line) {
  Lane* me = rt::current;
  if (!me) pl_fail("threadgroup_barrier outside a kernel", nullptr);
  me->state = AT_BARRIER;
  me->site = (const void*)(intptr_t)(line + 1);
  rt::wait_here();
}

// simdgroup_barrier: lanes of a simdgroup meet (a collective that moves nothing)
inline void c_none(const unsigned char*, unsigned char*, const int*, const bool*, int) {}
void simd_barrier() {
  char x = 0, y;
  collective(&x, &y, 1, 0, &c_none);
}

namespace rt {
// complete the collectives of one simdgroup: lanes waiting at the same function form a group
bool resolve_simdgroup(int first, int count) {
  bool any = false;
  for (;;) {
    const void* site = nullptr;
    int size = 0;
    for (int i = first; i < first + count; ++i) {
      if (lanes[i].state == AT_SIMD) {
        site = lanes[i].site;
        size = lanes[i].size;
        break;
      }
    }
    if (!site) return any;
    unsigned char in[32 * SLOT], out[32 * SLOT];
    int args[32];
    bool act[32];
    for (int l = 0; l < 32; ++l) {
      act[l] = false;
      args[l] = 0;
      const int i = first + l;
      if (l < count && lanes[i].state == AT_SIMD && lanes[i].site == site) {
        if (lanes[i].size != size) pl_fail("lanes of a simdgroup call one SIMD-group function on different types",
                                           &lanes[i].t);
        act[l] = true;
        args[l] = lanes[i].arg;
        memcpy(in + l * size, lanes[i].in, size);
      }
    }
    ((Combine)site)(in, out, args, act, size);
    for (int l = 0; l < 32; ++l) {
      if (!act[l]) continue;
      memcpy(lanes[first + l].out, out + l * size, size);
      lanes[first + l].state = READY;
    }
    any = true;
  }
}

// `reverse`: highest thread first. Threadgroups alternate the order, so that a thread reading threadgroup
// memory another wrote without a barrier between reads poison in one order or the other.
void run_threadgroup(int n, bool reverse) {
  for (int i = 0; i < n_tg; ++i) memset(tg[i].p, 0xff, tg[i].bytes);
  for (;;) {
    for (int j = 0; j < n; ++j) {
      const int i = reverse ? n - 1 - j : j;
      if (lanes[i].state != READY) continue;
      current = &lanes[i];
      fiber_swap(scheduler, lanes[i].fiber);
      current = nullptr;
    }
    bool any = false;
    for (int s = 0; s < n; s += 32) any = resolve_simdgroup(s, n - s < 32 ? n - s : 32) || any;
    if (any) continue;
    int live = 0;
    const void* site = nullptr;
    for (int i = 0; i < n; ++i) {
      if (lanes[i].state == DONE) continue;
      ++live;
      if (!site) site = lanes[i].site;
      if (lanes[i].site != site) {
        char msg[160];
        snprintf(msg, sizeof msg, "threads of a threadgroup wait at different threadgroup_barrier calls (lines %d, %d)",
                 (int)(intptr_t)site - 1, (int)(intptr_t)lanes[i].site - 1);
        pl_fail(msg, &lanes[i].t);
      }
    }
    if (live == 0) return;
    if (live < n) {  // MSL: every thread of the threadgroup must execute the barrier
      for (int i = 0; i < n; ++i) {
        if (lanes[i].state == DONE) pl_fail("a threadgroup_barrier this thread returned before reaching", &lanes[i].t);
      }
    }
    for (int i = 0; i < n; ++i) if (lanes[i].state == AT_BARRIER) lanes[i].state = READY;
  }
}

void launch(const uint* grid, const uint* group) {
  const uint tpt = group[0] * group[1] * group[2];
  if (tpt == 0 || tpt > MAX_THREADS) pl_fail("threads per threadgroup must be 1..1024", nullptr);
  unsigned char* stacks = (unsigned char*)mmap(nullptr, (size_t)tpt * (STACK + 4096), PROT_READ | PROT_WRITE,
                                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stacks == MAP_FAILED) pl_fail("cannot map the fiber stacks", nullptr);
  lanes = new Lane[tpt];
  for (uint i = 0; i < tpt; ++i) mprotect(stacks + (size_t)i * (STACK + 4096), 4096, PROT_NONE);  // overflow guard
  uint ngroups[3];
  for (int d = 0; d < 3; ++d) ngroups[d] = (grid[d] + group[d] - 1) / group[d];
  const long total = (long)ngroups[0] * ngroups[1] * ngroups[2];
  for (long g = total - 1; g >= 0; --g) {
    const uint gx = g % ngroups[0], gy = (g / ngroups[0]) % ngroups[1], gz = g / ((long)ngroups[0] * ngroups[1]);
    const uint gp[3] = {gx, gy, gz};
    uint size[3];  // dispatchThreads: the last threadgroup along a dimension may be partial
    for (int d = 0; d < 3; ++d) {
      const uint left = grid[d] - gp[d] * group[d];
      size[d] = left < group[d] ? left : group[d];
    }
    const int n = size[0] * size[1] * size[2];
    for (int i = 0; i < n; ++i) {
      Lane& L = lanes[i];
      Thread& t = L.t;
      const uint tx = i % size[0], ty = (i / size[0]) % size[1], tz = i / (size[0] * size[1]);
      t.thread_position_in_threadgroup = {tx, ty, tz};
      t.threadgroup_position_in_grid = {gx, gy, gz};
      t.thread_position_in_grid = {gx * group[0] + tx, gy * group[1] + ty, gz * group[2] + tz};
      t.threads_per_threadgroup = {size[0], size[1], size[2]};
      t.dispatch_threads_per_threadgroup = {group[0], group[1], group[2]};
      t.threadgroups_per_grid = {ngroups[0], ngroups[1], ngroups[2]};
      t.threads_per_grid = t.grid_size = {grid[0], grid[1], grid[2]};
      t.grid_origin = {0, 0, 0};
      t.thread_index_in_threadgroup = i;
      t.simdgroup_index_in_threadgroup = i / 32;
      t.thread_index_in_simdgroup = i % 32;
      t.threads_per_simdgroup = t.thread_execution_width = 32;
      t.simdgroups_per_threadgroup = (n + 31) / 32;
      t.dispatch_simdgroups_per_threadgroup = (tpt + 31) / 32;
      t.quadgroup_index_in_threadgroup = i / 4;
      t.thread_index_in_quadgroup = i % 4;
      t.quadgroups_per_threadgroup = (n + 3) / 4;
      t.dispatch_quadgroups_per_threadgroup = (tpt + 3) / 4;
      L.state = READY;
      L.site = nullptr;
      fiber_start(L.fiber, stacks + (size_t)i * (STACK + 4096) + 4096, STACK, trampoline);
    }
    n_lanes = n;
    run_threadgroup(n, g % 2 == 0);
  }
  delete[] lanes;
  munmap(stacks, (size_t)tpt * (STACK + 4096));
}

bool read_all(FILE* f, void* p, size_t n) { return fread(p, 1, n, f) == n; }
unsigned char* guarded(uint64_t nbytes) {
  const size_t page = 4096;
  const size_t body = ((nbytes + 15) / 16 * 16 + page - 1) / page * page;
  unsigned char* m = (unsigned char*)mmap(nullptr, body + page, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) pl_fail("cannot map a buffer", nullptr);
  mprotect(m + body, page, PROT_NONE);
  return m + body - (nbytes + 15) / 16 * 16;  // 16-byte aligned, its padded end against the guard page
}
}  // namespace rt

// launch file: grid[3] group[3] n_buffers (uint32), then per buffer: nbytes (uint64), ndim (int32),
// shape[8] (int32), strides[8] (int64), the bytes
int main_(int argc, char** argv, void (*thread_fn)(const Thread&)) {
  if (argc != 3) pl_fail("usage: emulator LAUNCH_FILE OUTPUT_FILE", nullptr);
  FILE* f = fopen(argv[1], "rb");
  if (!f) pl_fail("cannot open the launch file", nullptr);
  uint head[7];
  if (!rt::read_all(f, head, sizeof head)) pl_fail("short launch file", nullptr);
  n_buffers = head[6];
  if (n_buffers > 64) pl_fail("more than 64 buffers", nullptr);
  for (int i = 0; i < n_buffers; ++i) {
    Buffer& b = buffers[i];
    if (!rt::read_all(f, &b.nbytes, 8) || !rt::read_all(f, &b.ndim, 4) || !rt::read_all(f, b.shape, 32) ||
        !rt::read_all(f, b.strides, 64))
      pl_fail("short launch file", nullptr);
    b.data = rt::guarded(b.nbytes);
    if (!rt::read_all(f, b.data, b.nbytes)) pl_fail("short launch file", nullptr);
  }
  fclose(f);
  rt::entry = thread_fn;
  rt::launch(head, head + 3);
  FILE* o = fopen(argv[2], "wb");
  if (!o) pl_fail("cannot write the output file", nullptr);
  for (int i = 0; i < n_buffers; ++i) fwrite(buffers[i].data, 1, buffers[i].nbytes, o);
  fclose(o);
  printf("threadgroup_memory=%zu\n", rt::tg_bytes);
  return 0;
}
}  // namespace pl
