/* gloo_backend.cc — the "cpu" communication backend: Gloo's TCP transport behind the C table
 * dt_comm_backend_t (see ../backend.h). Every entry point catches every C++ exception and turns
 * it into a DT_E* code plus one log line; nothing here throws across the C boundary.
 *
 * What comes from Gloo and what is ours. Gloo provides the transport: sockets, its event-loop
 * thread, pairs, and "unbound buffers" (post a send or a receive on a (peer, slot), wait for
 * completion). The algorithms are ours, written on those buffers:
 *  - reduce-scatter: ring, pipelined in 512 KiB segments (the 2022 Gloo has no reduce-scatter
 *    in its options API at all);
 *  - all-gather: ring, pipelined the same way (uneven counts included);
 *  - all-reduce: recursive doubling (world 2, or small buffers on a power-of-two world), else
 *    our reduce-scatter then our all-gather, in place;
 *  - broadcast: a pipelined chain from the root; barrier: dissemination;
 *  - send/recv: the payload after an 8-byte header from the receiver with the size it expects,
 *    so that a size mismatch is an error rather than a failed assertion on Gloo's event-loop
 *    thread (which ends the process) or a short message taken for a whole one;
 *  - rendezvous (connect_mesh): instead of gloo::rendezvous::Context::connectFullMesh and a
 *    Store adapter, because we need one deadline for the whole rendezvous, the list of ranks
 *    that never arrived, and cancellation by abort.
 * Why not gloo::allreduce and friends: a wait inside them cannot be interrupted from outside.
 * When a peer dies or the communicator is aborted, Gloo fails the pairs and wakes every wait
 * whose message has not started arriving, but a wait on a message that is half-read stays
 * asleep until its timeout (measured: 2 of 15 runs of a 3-rank all-reduce with a SIGKILLed
 * peer took the full 4 s timeout instead of ~25 ms). Training timeouts are minutes, so abort
 * must not depend on them. Owning the waits lets the watchdog below interrupt them. It costs
 * no speed: on loopback with 2 ranks our all-reduce matched gloo::allreduce (ring) at 16 and
 * 64 MiB and beat torch.distributed's gloo; at 1 MiB all three were within the scheduling noise
 * of a shared 2-core machine (tests/bench/bench_allreduce.c, bench_allreduce_torch.py).
 * DISTRAIN_COMM_CPU_GLOO_ALLREDUCE=1 selects gloo::allreduce instead of ours, for comparison
 * in benchmarks only: it has the gap just described.
 *
 * Failure model. Gloo fails a pair when its socket breaks (a peer died, or closed its end), and
 * a whole transport context (tcp::Context::signalException: every pair failed, pending
 * operations woken with an exception, sockets closed) when any wait times out; poison() below
 * triggers the latter on purpose after any error and on abort, so peers blocked on us fail
 * promptly with "Connection closed by peer" (DT_EREMOTE). An operation fails only if it needs
 * a failed pair: a peer that sent us its last bytes and then destroyed its communicator is not
 * an error. The watchdog thread of each communicator sleeps in a receive that no peer ever
 * satisfies (the sentinel, posted to every live peer); a pair failure wakes it with an
 * exception, it re-arms (learning which pairs are dead, since posting on a failed pair throws)
 * and interrupts whatever the operation thread waits on (UnboundBuffer::abortWait*, public
 * API). The operation thread then fails if its own peer is dead, or resumes waiting (see
 * wait_op). After an operation fails, this instance only fails (comm.c stops calling it).
 *
 * Timeouts bound progress, not duration: every wait for a peer gives up after the
 * communicator's timeout, so a large transfer that keeps moving never times out and a stalled
 * one fails within one timeout. Rendezvous has one deadline for all peers. */
#include <ifaddrs.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

extern "C" {
#include "backend.h"
#include "dt_error.h"
#include "dt_log.h"
#include "dt_util.h"
}

namespace
{

using ms = std::chrono::milliseconds;
using gloo::transport::UnboundBuffer;
using Buf = std::unique_ptr<UnboundBuffer>;

/* Slot prefixes of our traffic (Gloo's own collectives use 0x01..0x08). The tag part of a slot
 * is the collective's sequence number, or the user's tag for point-to-point. */
constexpr uint8_t kSlotReduceScatter = 0x40;
constexpr uint8_t kSlotAllGather = 0x41;
constexpr uint8_t kSlotBroadcast = 0x42;
constexpr uint8_t kSlotBarrier = 0x43;
constexpr uint8_t kSlotP2P = 0x44;
constexpr uint8_t kSlotSentinel = 0x45;
constexpr uint8_t kSlotAllReduce = 0x46;
constexpr uint8_t kSlotP2PHeader = 0x47;

/* Gloo's tcp pair waits this many times its context's timeout for a connection (the 2022
 * Gloo's "longer timeout when waiting for initial connect"). */
constexpr int kConnectWaits = 5;

/* Pipelining unit of the ring and chain algorithms (elements): small enough that a segment's
 * transfer overlaps the previous one's reduction and forwarding, large enough to amortise the
 * per-message cost (a notification round trip). */
constexpr size_t kSegElems = 128 * 1024;

/* All-reduce algorithm: recursive doubling (log2 W exchanges of the whole buffer, W a power of
 * two) or the ring (2(W-1) steps of 1/W of it). Each rank sends (W-1)/W * 2 * bytes on the ring
 * and log2(W) * bytes doubling: equal for W = 2, where doubling halves the steps and always
 * wins (2 processes on loopback: 1 MiB 0.5-1.0 GB/s vs the ring's 0.27-0.35, 16 MiB 1.5-1.6 vs
 * 1.3-1.4, 64 MiB 1.7-1.8 vs 1.6-1.75; a step costs milliseconds of wake-ups on a busy 2-core
 * machine). For larger powers of two doubling sends more, so it is used only up to this size,
 * where the step count dominates. */
constexpr size_t kDoublingMaxBytes = 4u << 20;

/* "Forever" for the watchdog's wait: about 10 years, far from steady_clock overflow. */
constexpr ms kForever = std::chrono::hours(24 * 365 * 10);

/* A gloo::Context over a transport context that connect_mesh connected (for gloo::allreduce). */
class MeshContext : public gloo::Context
{
public:
  MeshContext(int my_rank, int nranks, std::shared_ptr<gloo::transport::Device> dev,
              std::shared_ptr<gloo::transport::Context> tctx, ms timeout)
      : gloo::Context(my_rank, nranks)
  {
    device_ = std::move(dev);
    transportContext_ = std::move(tctx);
    setTimeout(timeout);
  }
};

struct Gloo {
  std::string prefix;
  std::string name;   /* in log lines after init: prefix, or "label (prefix)" */
  std::mutex name_mu; /* name's: gloo_set_label and the sentinel thread's log line */
  int rank = 0, world = 1;
  ms timeout{0};
  bool gloo_allreduce = false;
  bool idle_io = false; /* Gloo's event-loop thread in the idle class (create_device) */
  std::shared_ptr<gloo::transport::Device> dev; /* shared with split children */
  std::shared_ptr<gloo::transport::Context> tctx;
  std::shared_ptr<MeshContext> ctx;
  std::atomic<bool> aborted{false};
  const Gloo *parent = nullptr; /* during init only: a split's parent, whose abort cancels us */
  std::mutex tctx_mu;           /* serialises poison() and the publication of tctx */
  uint32_t seq = 0;             /* collectives issued: the tag of the next one */
  std::vector<float> scratch;   /* reduce-scatter staging, kept between calls */

  /* Watchdog (see the file comment). Under active_mu: active lists the buffers the operation
   * thread may be waiting on (interrupt() aborts their waits); dead[i] is set once the pair to
   * rank i has failed; sentinel is the buffer the watchdog sleeps on; stopping ends it. */
  char sentinel_byte = 0;
  std::thread watchdog;
  std::mutex active_mu;
  std::vector<UnboundBuffer *> active;
  std::vector<char> dead;
  UnboundBuffer *sentinel = nullptr;
  bool stopping = false;
  std::vector<Buf> sentinels; /* every sentinel armed (watchdog thread only): receives stay
                                 posted on healthy pairs, so their buffers must live on */
};

std::string name_of(Gloo *g)
{
  std::lock_guard<std::mutex> lock(g->name_mu);
  return g->name;
}

/* ------------------------------------------------------------------------------------------ */
/* Errors and interruption                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Thrown when abort interrupted a wait. */
struct Interrupted : gloo::IoException {
  Interrupted() : gloo::IoException("communicator aborted") {}
};

/* Thrown when the pair to a peer an operation needs has failed. */
struct PeerFailed : gloo::IoException {
  explicit PeerFailed(int peer)
      : gloo::IoException("connection to rank " + std::to_string(peer) + " failed")
  {
  }
};

/* Fails every connection of g (idempotent): pending waits throw and peers see their sockets
 * close. The 2022 Gloo has no public call for this (tcp::Context::signalException is
 * protected, and tcp/context.h cannot even be included from the Debian package, which lacks
 * gloo/common/memory.h), but Gloo fails the whole transport context whenever a wait times out
 * ("Application timeout caused pair closure"). So a zero-timeout wait on a private buffer does
 * exactly what we need, through public API only. */
void poison(Gloo *g)
{
  std::lock_guard<std::mutex> lock(g->tctx_mu);
  if (!g->tctx || g->world == 1)
    return;
  try {
    char dummy = 0;
    auto buf = g->tctx->createUnboundBuffer(&dummy, sizeof dummy);
    buf->waitRecv(ms(0));
  } catch (...) { /* the expected outcome: the context is now failed */
  }
}

/* Wakes the operation thread out of its current wait (or its next one, if it is not waiting:
 * Gloo's abort flags stick until a wait consumes them). */
void interrupt(Gloo *g)
{
  std::lock_guard<std::mutex> lock(g->active_mu);
  for (UnboundBuffer *b : g->active) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

/* Registers buffers for interrupt() for its lifetime. Declare it after the buffers (so that it
 * unregisters them before they are destroyed) and before posting anything on them. */
class Active
{
public:
  Active(Gloo *g, std::initializer_list<UnboundBuffer *> bufs)
      : Active(g, std::vector<UnboundBuffer *>(bufs))
  {
  }
  Active(Gloo *g, const std::vector<UnboundBuffer *> &bufs) : g_(g)
  {
    std::lock_guard<std::mutex> lock(g_->active_mu);
    for (UnboundBuffer *b : bufs)
      if (b) {
        g_->active.push_back(b);
        mine_.push_back(b);
      }
  }
  ~Active()
  {
    std::lock_guard<std::mutex> lock(g_->active_mu);
    for (UnboundBuffer *b : mine_)
      g_->active.erase(std::find(g_->active.begin(), g_->active.end(), b));
  }
  Active(const Active &) = delete;
  Active &operator=(const Active &) = delete;

private:
  Gloo *g_;
  std::vector<UnboundBuffer *> mine_;
};

bool peer_dead(Gloo *g, int peer)
{
  std::lock_guard<std::mutex> lock(g->active_mu);
  return g->dead[peer] != 0;
}

/* Waits for one receive (send) completion on b, whose operations all involve `peer`.
 * Interrupted (Gloo's wait returns false): on abort, fail; if the pair to peer has not failed,
 * the interruption was about another pair, so keep waiting; if it has, take a completion that
 * already arrived (a peer that sent its last bytes and then left is not a failure) or fail.
 * That last zero-timeout wait throws at once when the pair's failure reached b, and otherwise
 * (b's message was half-read) fails the context through Gloo's timeout path. */
template <bool kRecv> void wait_op(Gloo *g, UnboundBuffer *b, int peer)
{
  for (;;) {
    /* A peer already known dead: no blocking wait. The watchdog's interrupt may have been
     * consumed by an earlier wait on b whose message had completed, and this one may be on a
     * half-read message that nothing else would wake before the timeout. (The watchdog marks
     * the peer dead before interrupting, so a wait that starts after this check still sees
     * the interrupt.) */
    if (!peer_dead(g, peer) && (kRecv ? b->waitRecv(g->timeout) : b->waitSend(g->timeout)))
      return;
    if (g->aborted.load())
      throw Interrupted();
    if (!peer_dead(g, peer))
      continue;
    try {
      /* Twice: an abort flag set while b's completion was already in wins over it and is
       * consumed by the first call (Gloo checks the flag after the count); the watchdog sets
       * that flag on every active buffer, this one included, when the peer left. */
      for (int i = 0; i < 2; i++)
        if (kRecv ? b->waitRecv(ms(0)) : b->waitSend(ms(0)))
          return;
    } catch (...) {
    }
    throw PeerFailed(peer);
  }
}

void wait_recv(Gloo *g, UnboundBuffer *b, int peer)
{
  wait_op<true>(g, b, peer);
}

void wait_send(Gloo *g, UnboundBuffer *b, int peer)
{
  wait_op<false>(g, b, peer);
}

/* The watchdog: arms a sentinel (one never-satisfied receive per live peer) and sleeps on it.
 * A pair failure wakes it with an exception; it re-arms, which tells it which pairs are dead
 * (posting on a failed pair throws), records them, then interrupts the operation thread. */
void watch(Gloo *g)
{
  for (bool first = true;; first = false) {
    Buf s = g->tctx->createUnboundBuffer(&g->sentinel_byte, sizeof g->sentinel_byte);
    int armed = 0;
    {
      std::lock_guard<std::mutex> lock(g->active_mu);
      if (g->stopping)
        return;
      for (int i = 0; i < g->world; i++) {
        if (i == g->rank || g->dead[i])
          continue;
        try {
          s->recv(i, gloo::Slot::build(kSlotSentinel, 0));
          armed++;
        } catch (...) {
          g->dead[i] = 1;
          DT_DEBUG(COMM, "comm %s rank %d/%d: connection to rank %d closed", name_of(g).c_str(),
                   g->rank, g->world, i);
        }
      }
      g->sentinel = s.get();
    }
    if (!first)
      interrupt(g);
    UnboundBuffer *cur = s.get();
    g->sentinels.push_back(std::move(s));
    if (armed == 0)
      return; /* every pair has failed: nothing left to watch */
    try {
      if (!cur->waitRecv(kForever))
        return;     /* destroy: abortWaitRecv */
    } catch (...) { /* a pair failed */
    }
  }
}

/* Converts the exception in flight into a DT_E* code, logs it, and fails the context. */
int on_exception(Gloo *g, const char *what)
{
  int rc = DT_EINTERNAL;
  std::string msg = "unknown exception";
  try {
    throw;
  } catch (const Interrupted &e) {
    msg = e.what();
    rc = DT_ECANCELED;
  } catch (const PeerFailed &e) {
    msg = e.what();
    rc = DT_EREMOTE;
  } catch (const gloo::IoException &e) {
    msg = e.what();
    rc = msg.find("Timed out") != std::string::npos ? DT_ETIMEDOUT : DT_EREMOTE;
  } catch (const std::bad_alloc &) {
    msg = "out of memory";
    rc = DT_ENOMEM;
  } catch (const std::exception &e) {
    msg = e.what();
  } catch (...) {
  }
  if (g->aborted.load()) {
    rc = DT_ECANCELED;
    DT_DEBUG(COMM, "comm %s rank %d/%d: %s canceled (%s)", name_of(g).c_str(), g->rank, g->world,
             what, msg.c_str());
  } else {
    DT_ERROR(COMM, "comm %s rank %d/%d: %s failed (%s): %s", name_of(g).c_str(), g->rank, g->world,
             what, dt_err_name(rc), msg.c_str());
  }
  poison(g);
  return rc;
}

/* Runs f, mapping exceptions to codes. f returns 0 or a DT_E* code of its own. */
template <class F> int guarded(Gloo *g, const char *what, F &&f)
{
  if (g->aborted.load())
    return DT_ECANCELED;
  try {
    int rc = f();
    if (rc < 0)
      poison(g);
    return rc;
  } catch (...) {
    return on_exception(g, what);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Rendezvous                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* The interfaces that are up and have an IPv4 or IPv6 address, as "lo, eth0"; *has_iface tells
 * whether `iface` is among them. Checked before Gloo looks, because Gloo's own lookup leaks its
 * getifaddrs list when it throws for a missing interface. */
std::string interfaces_with_address(const char *iface, bool *has_iface)
{
  std::vector<std::string> names;
  struct ifaddrs *list = nullptr;
  *has_iface = false;
  if (getifaddrs(&list) != 0)
    return "?";
  for (struct ifaddrs *a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || !(a->ifa_flags & IFF_UP) ||
        (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6))
      continue;
    if (strcmp(a->ifa_name, iface) == 0)
      *has_iface = true;
    if (std::find(names.begin(), names.end(), a->ifa_name) == names.end())
      names.push_back(a->ifa_name);
  }
  freeifaddrs(list);
  std::string out;
  for (const auto &n : names)
    out += (out.empty() ? "" : ", ") + n;
  return out;
}

/* Whether Gloo's event-loop thread (the device's, which does all socket I/O) runs in the idle
 * scheduling class (Gloo::idle_io): DISTRAIN_COMM_CPU_IDLE_IO=1|0, else dt_io_yields(): where
 * the process may run on one CPU, or where the node has no CPU to spare beyond its ranks' compute
 * threads, unless collectives overlap compute with ranks on other nodes.
 *
 * Why. When that thread wakes while the operation thread holds a pair's lock (posting a send
 * writes it to the socket under the lock), its handler's try_lock fails and returns, and epoll,
 * level-triggered, reports the same event at once: it spins until the scheduler ends its slice,
 * while the lock's holder waits for the CPU it spins on. Every CPU busy with compute makes that
 * the rule rather than the exception:
 *  - a trainer pinned to one core (bench_allreduce --pin 1, 2 ranks): a 256 KiB exchange took
 *    2.5 ms instead of 0.12, a 1 MiB all-reduce 4.0 instead of 0.34, and interleaved pipeline
 *    stages spent 5 points of their step in such exchanges;
 *  - 4 trainers of one thread on 2 cores (pp 2 x tp 2, 40 steps of a 4-layer C128 model): the
 *    event-loop threads took half the processes' CPU time, nearly all of it in epoll_wait
 *    (perf), and the run 10.1 s with 11.4 s of system time; idle, 5.3 s with 1.9;
 *  - 2 data-parallel ranks of one thread on 2 cores (tests/bench/bench_dp.py): ZeRO-0, -2 and -3
 *    steps 3%, 9% and 8% faster idle (435 / 424 / 427 ms against 447 / 465 / 464).
 * In the idle class the thread never preempts the trainer's threads and runs whenever they wait,
 * which is when they need it. With a CPU to spare it has one to run on beside them, where an
 * idle-class thread could starve behind other work, so there it stays a normal thread. So it does
 * where the data-parallel comm thread overlaps collectives with compute across nodes: the
 * network then needs the thread while every CPU computes. With 2 ranks on 2 cores whose loopback
 * was held to 1 Gbit/s (tc tbf), ZeRO-3 steps took 640 / 642 ms with a normal thread and 675 / 664
 * idle (ZeRO-2 even); with all ranks on one node the comm is CPU-bound, and idle won as above.
 *
 * Gloo's TCP device; its event-loop thread inherits its creator's scheduling policy, so an idle
 * one is created from a short-lived thread of that class. */
std::shared_ptr<gloo::transport::Device> create_device(const gloo::transport::tcp::attr &attr,
                                                       bool idle)
{
  if (!idle)
    return gloo::transport::tcp::CreateDevice(attr);
  std::shared_ptr<gloo::transport::Device> dev;
  std::exception_ptr failed;
  std::thread creator([&] {
    struct sched_param none = {};
    if (sched_setscheduler(0, SCHED_IDLE, &none) != 0)
      DT_WARN(COMM, "comm: could not put the I/O thread in the idle class: %s", strerror(errno));
    try {
      dev = gloo::transport::tcp::CreateDevice(attr);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  creator.join();
  if (failed)
    std::rethrow_exception(failed);
  return dev;
}

/* The TCP device this rank listens on: DISTRAIN_COMM_IFACE's address, else DISTRAIN_COMM_HOST's,
 * else the host name's. An interface without an address or a name that does not resolve is a
 * setting to fix, so the error names the setting rather than only Gloo's internal check. */
int make_device(const Gloo *g, std::shared_ptr<gloo::transport::Device> *out)
{
  gloo::transport::tcp::attr attr;
  const char *iface = getenv("DISTRAIN_COMM_IFACE");
  const char *host = getenv("DISTRAIN_COMM_HOST");
  std::string from;
  if (iface && *iface) {
    bool found = false;
    std::string names = interfaces_with_address(iface, &found);
    if (!found) {
      DT_ERROR(COMM,
               "comm %s rank %d/%d: DISTRAIN_COMM_IFACE=%s is not an interface that is up with an "
               "IP address (these are: %s)",
               g->prefix.c_str(), g->rank, g->world, iface, names.c_str());
      return DT_EINVAL;
    }
    attr.iface = iface;
    from = std::string("DISTRAIN_COMM_IFACE=") + iface;
  } else if (host && *host) {
    attr.hostname = host;
    from = std::string("DISTRAIN_COMM_HOST=") + host;
  } else {
    char name[256] = "";
    if (gethostname(name, sizeof name - 1) == 0 && *name)
      attr.hostname = name;
    from = std::string("the host name '") + name +
           "' (set DISTRAIN_COMM_IFACE or DISTRAIN_COMM_HOST to choose an address)";
  }
  try {
    *out = create_device(attr, g->idle_io);
    return 0;
  } catch (const std::exception &e) {
    DT_ERROR(COMM, "comm %s rank %d/%d: no address to listen on from %s: %s", g->prefix.c_str(),
             g->rank, g->world, from.c_str(), e.what());
    return DT_EINVAL;
  }
}

int canceled(void *arg)
{
  const Gloo *g = static_cast<const Gloo *>(arg);
  return g->aborted.load() || (g->parent && g->parent->aborted.load());
}

std::string addr_key(const Gloo *g, int rank)
{
  return g->prefix + "/cpu/addr/" + std::to_string(rank);
}

/* After a rendezvous timeout at peer `first`: names every rank that has not posted. */
void report_missing(Gloo *g, const dt_kv_t *kv, int first)
{
  std::string missing;
  int n = 0;
  for (int i = first; i < g->world; i++) {
    if (i == g->rank)
      continue;
    void *val = nullptr;
    size_t len = 0;
    bool there = i != first && kv->get(kv->ud, addr_key(g, i).c_str(), &val, &len, 0) == 0;
    free(val);
    if (!there)
      missing += (n++ ? ", " : "") + std::to_string(i);
  }
  DT_ERROR(COMM,
           "comm %s rank %d/%d: rendezvous timed out after %lld ms; missing rank%s %s "
           "(never posted %s/cpu/addr/<rank>)",
           g->prefix.c_str(), g->rank, g->world, (long long)g->timeout.count(), n > 1 ? "s" : "",
           missing.c_str(), g->prefix.c_str());
}

/* Posts this rank's listening addresses (one per peer) under <prefix>/cpu/addr/<rank>, reads
 * every peer's, and connects the full mesh. The value is Gloo's address bytes for peers
 * 0..world-1 without ourselves, in rank order, all of one size (Gloo's own layout). */
int connect_mesh(Gloo *g, const dt_kv_t *kv, double deadline_ms)
{
  std::vector<char> mine;
  size_t addr_size = 0;
  for (int i = 0; i < g->world; i++) {
    if (i == g->rank)
      continue;
    auto bytes = g->tctx->createPair(i)->address().bytes();
    addr_size = bytes.size();
    mine.insert(mine.end(), bytes.begin(), bytes.end());
  }
  int rc = kv->put(kv->ud, addr_key(g, g->rank).c_str(), mine.data(), mine.size());
  if (rc < 0) {
    DT_ERROR(COMM, "comm %s rank %d: posting the address failed: %s", g->prefix.c_str(), g->rank,
             dt_strerror(rc));
    return rc;
  }

  std::vector<std::vector<char>> peer_addr(g->world);
  for (int i = 0; i < g->world; i++) {
    if (i == g->rank)
      continue;
    void *val = nullptr;
    size_t len = 0;
    rc = dt__comm_kv_wait(kv, addr_key(g, i).c_str(), &val, &len, deadline_ms, canceled, g);
    if (rc == DT_ETIMEDOUT)
      report_missing(g, kv, i);
    if (rc < 0)
      return rc;
    std::unique_ptr<char, decltype(&free)> hold(static_cast<char *>(val), free);
    if (len != mine.size()) {
      DT_ERROR(COMM,
               "comm %s rank %d: rank %d posted %zu address bytes, expected %zu (a different "
               "world size or Gloo version?)",
               g->prefix.c_str(), g->rank, i, len, mine.size());
      return DT_EFORMAT;
    }
    size_t slot = (size_t)(g->rank < i ? g->rank : g->rank - 1);
    peer_addr[i].assign(hold.get() + slot * addr_size, hold.get() + (slot + 1) * addr_size);
  }
  /* Connect in rank order: each pair's listening side accepts on Gloo's loop thread, so the
   * order cannot deadlock; each connect waits at most the timeout (see kConnectWaits). An
   * address another run left in the store makes both ends listen (each believes it is the
   * smaller address), hence the hint. */
  for (int i = 0; i < g->world; i++) {
    if (i == g->rank)
      continue;
    if (canceled(g))
      return DT_ECANCELED;
    try {
      g->tctx->getPair(i)->connect(peer_addr[i]);
    } catch (const gloo::IoException &e) {
      if (!strstr(e.what(), "Connect timeout"))
        throw;
      DT_ERROR(COMM,
               "comm %s rank %d/%d: rendezvous: rank %d did not connect within %lld ms; if the "
               "store holds addresses from an earlier run, use a fresh one (a new "
               "DISTRAIN_KV_DIR or DISTRAIN_KV_PREFIX)",
               g->prefix.c_str(), g->rank, g->world, i, (long long)g->timeout.count());
      return DT_ETIMEDOUT;
    }
  }
  return 0;
}

/* Writing to a socket whose peer died raises SIGPIPE, which by default kills the process; a
 * dead peer must be an error instead. Only a default disposition is changed. */
void ignore_sigpipe()
{
  struct sigaction sa;
  if (sigaction(SIGPIPE, nullptr, &sa) == 0 && sa.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
    DT_DEBUG(COMM, "SIGPIPE ignored (sockets report EPIPE instead)");
  }
}

void gloo_destroy(void *impl)
{
  Gloo *g = static_cast<Gloo *>(impl);
  try {
    if (g->watchdog.joinable()) {
      {
        std::lock_guard<std::mutex> lock(g->active_mu);
        g->stopping = true;
        if (g->sentinel)
          g->sentinel->abortWaitRecv();
      }
      g->watchdog.join();
    }
    delete g;
  } catch (...) { /* nothing here should throw; never let it cross into C */
  }
}

int gloo_init(void **impl, const dt_kv_t *kv, const char *prefix, int rank, int world,
              int timeout_ms, void *share)
{
  Gloo *g = nullptr;
  try {
    g = new Gloo;
    g->prefix = g->name = prefix;
    g->rank = rank;
    g->world = world;
    g->timeout = ms(timeout_ms);
    g->parent = static_cast<const Gloo *>(share);
    g->idle_io = dt_io_yields();
  } catch (...) {
    delete g;
    return DT_ENOMEM;
  }
  int gloo_allreduce = g->gloo_allreduce, idle_io = g->idle_io;
  int erc = dt_env_switch("DISTRAIN_COMM_CPU_GLOO_ALLREDUCE", &gloo_allreduce);
  if (erc == 0)
    erc = dt_env_switch("DISTRAIN_COMM_CPU_IDLE_IO", &idle_io);
  if (erc < 0) {
    delete g;
    return erc;
  }
  g->gloo_allreduce = gloo_allreduce;
  g->idle_io = idle_io;
  double deadline_ms = dt_now_ms() + timeout_ms;
  ignore_sigpipe();
  int rc = guarded(g, "rendezvous", [&]() -> int {
    if (g->parent) {
      g->dev = g->parent->dev;
    } else {
      int drc = make_device(g, &g->dev);
      if (drc < 0)
        return drc;
    }
    {
      std::lock_guard<std::mutex> lock(g->tctx_mu);
      g->tctx = g->dev->createContext(rank, world);
      /* The context's timeout only bounds connecting (every wait passes its own), and Gloo
       * waits kConnectWaits times it for a connection. */
      g->tctx->setTimeout(std::max(ms(1), g->timeout / kConnectWaits));
    }
    int crc = connect_mesh(g, kv, deadline_ms);
    if (crc < 0)
      return crc;
    g->ctx = std::make_shared<MeshContext>(rank, world, g->dev, g->tctx, g->timeout);
    if (world > 1) {
      g->dead.assign(world, 0);
      g->watchdog = std::thread(watch, g);
    }
    return 0;
  });
  g->parent = nullptr;
  if (rc < 0) {
    gloo_destroy(g);
    return rc;
  }
  *impl = g;
  return 0;
}

void gloo_abort(void *impl)
{
  Gloo *g = static_cast<Gloo *>(impl);
  g->aborted.store(true);
  interrupt(g);
  poison(g); /* peers blocked on us fail now */
}

/* ------------------------------------------------------------------------------------------ */
/* Reductions and segments                                                                     */
/* ------------------------------------------------------------------------------------------ */

void reduce_sum(void *c_, const void *a_, const void *b_, size_t n)
{
  float *c = static_cast<float *>(c_);
  const float *a = static_cast<const float *>(a_);
  const float *b = static_cast<const float *>(b_);
  for (size_t i = 0; i < n; i++)
    c[i] = a[i] + b[i];
}

void scale_avg(float *buf, size_t n, int world)
{
  const float w = (float)world;
  for (size_t i = 0; i < n; i++)
    buf[i] /= w;
}

/* A chunked float buffer: chunk c has count[c] elements at off[c]; each chunk is cut into
 * segments of kSegElems (the last one shorter). Both ends of every message compute the same
 * layout from the same counts, which is what makes in-order matching correct. */
struct Layout {
  std::vector<size_t> count, off;
  explicit Layout(const size_t *counts, int world) : count(counts, counts + world), off(world + 1)
  {
    off[0] = 0;
    for (int c = 0; c < world; c++)
      off[c + 1] = off[c] + count[c];
  }
  size_t nseg(int c) const
  {
    return (count[c] + kSegElems - 1) / kSegElems;
  }
  size_t seg_len(int c, size_t j) const
  {
    return std::min(kSegElems, count[c] - j * kSegElems);
  }
  size_t max_count() const
  {
    return *std::max_element(count.begin(), count.end());
  }
};

constexpr size_t F = sizeof(float);

/* ------------------------------------------------------------------------------------------ */
/* Ring reduce-scatter                                                                         */
/* ------------------------------------------------------------------------------------------ */

/* Chunk c (L.count[c] elements at L.off[c] of in) ends reduced on rank c, in out. In step s
 * (0..W-2) rank r sends its partial sum of chunk (r-s-1) mod W to r+1 and receives r-1's
 * partial of chunk (r-s-2) mod W, adds its own input to it and forwards that in step s+1;
 * after the last step the chunk received is (r-W) mod W = r, complete. Partials live in two
 * staging buffers (step s receives into stage[s%2], step s+1 sends from it); before step
 * s+1's receives reuse a buffer, step s's sends from it must be done. The last step receives
 * into out directly, or into staging when out lies inside in (all-reduce). Segment j of step
 * s+1 is sent as soon as segment j of step s is reduced, so transfers overlap additions. All
 * messages share one slot: Gloo matches a pair's sends and receives on a slot in posting
 * order, and both ends post the same (chunk, segment) sequence. */
void ring_reduce_scatter(Gloo *g, const float *in, float *out, const Layout &L, bool out_in_in)
{
  const int W = g->world, r = g->rank;
  const uint64_t slot = gloo::Slot::build(kSlotReduceScatter, g->seq++);
  const int right = (r + 1) % W, left = (r + W - 1) % W;
  const size_t max_count = L.max_count();
  if (g->scratch.size() < 2 * max_count)
    g->scratch.resize(2 * max_count);

  auto &tctx = g->tctx;
  float *stage[2] = {g->scratch.data(), g->scratch.data() + max_count};
  Buf in_buf = tctx->createUnboundBuffer(const_cast<float *>(in), L.off[W] * F);
  Buf out_buf = tctx->createUnboundBuffer(out, L.count[r] * F);
  Buf stage_buf[2] = {tctx->createUnboundBuffer(stage[0], max_count * F),
                      tctx->createUnboundBuffer(stage[1], max_count * F)};
  Active active(g, {in_buf.get(), out_buf.get(), stage_buf[0].get(), stage_buf[1].get()});

  auto send_chunk = [&](int s) { return (r - s - 1 + 2 * W) % W; };
  auto recv_chunk = [&](int s) { return (r - s - 2 + 2 * W) % W; };
  const bool direct = !out_in_in; /* the last step receives straight into out */
  auto dst_buf = [&](int s) {
    return s == W - 2 && direct ? out_buf.get() : stage_buf[s % 2].get();
  };
  auto dst_ptr = [&](int s) { return s == W - 2 && direct ? out : stage[s % 2]; };
  auto post_recvs = [&](int s) {
    const int c = recv_chunk(s);
    for (size_t j = 0; j < L.nseg(c); j++)
      dst_buf(s)->recv(left, slot, j * kSegElems * F, L.seg_len(c, j) * F);
  };

  /* Step 0 sends straight from the input; later steps forward reduced segments. */
  post_recvs(0);
  for (size_t j = 0, c = send_chunk(0); j < L.nseg(c); j++)
    in_buf->send(right, slot, (L.off[c] + j * kSegElems) * F, L.seg_len(c, j) * F);
  UnboundBuffer *sent_from = in_buf.get(); /* the buffer step s's sends read */
  for (int s = 0; s <= W - 2; s++) {
    const int c = recv_chunk(s);
    float *dst = dst_ptr(s), *sum = s == W - 2 ? out : dst;
    for (size_t j = 0; j < L.nseg(c); j++) {
      wait_recv(g, dst_buf(s), left);
      const size_t o = j * kSegElems, len = L.seg_len(c, j);
      reduce_sum(sum + o, dst + o, in + L.off[c] + o, len);
      if (s < W - 2) /* chunk c is the one step s+1 sends */
        dst_buf(s)->send(right, slot, o * F, len * F);
    }
    for (size_t j = 0; j < L.nseg(send_chunk(s)); j++)
      wait_send(g, sent_from, right);
    sent_from = dst_buf(s);
    if (s < W - 2)
      post_recvs(s + 1);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Ring all-gather                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* out holds every chunk at L.off; this rank's is already in place. In step s (0..W-2) rank r
 * sends chunk (r-s) mod W to r+1 and receives chunk (r-s-1) mod W from r-1, straight into its
 * final place, so every receive is posted up front (the constructor) and each received
 * segment is forwarded as soon as it lands, except in the last step (run). All-reduce
 * constructs it before its reduce-scatter: with our receives announced early, each peer's
 * all-gather sends leave at once instead of after a notification round trip. That is safe
 * because chunk c reaches us only after its owner completed it, which needs every read this
 * rank's reduce-scatter makes of chunk c (our contribution) to be over. */
class RingAllGather
{
public:
  RingAllGather(Gloo *g, float *out, const Layout &L)
      : g_(g), L_(L), slot_(gloo::Slot::build(kSlotAllGather, g->seq++)),
        right_((g->rank + 1) % g->world), left_((g->rank + g->world - 1) % g->world),
        buf_(g->tctx->createUnboundBuffer(out, L.off[g->world] * F)), active_(g, {buf_.get()})
  {
    const int W = g_->world, r = g_->rank;
    for (int s = 0; s <= W - 2; s++) {
      const int c = (r - s - 1 + 2 * W) % W;
      for (size_t j = 0; j < L_.nseg(c); j++)
        buf_->recv(left_, slot_, (L_.off[c] + j * kSegElems) * F, L_.seg_len(c, j) * F);
    }
  }

  void run()
  {
    const int W = g_->world, r = g_->rank;
    size_t sends = 0;
    for (size_t j = 0; j < L_.nseg(r); j++, sends++)
      buf_->send(right_, slot_, (L_.off[r] + j * kSegElems) * F, L_.seg_len(r, j) * F);
    for (int s = 0; s <= W - 2; s++) {
      const int c = (r - s - 1 + 2 * W) % W;
      for (size_t j = 0; j < L_.nseg(c); j++) {
        wait_recv(g_, buf_.get(), left_);
        if (s < W - 2) {
          buf_->send(right_, slot_, (L_.off[c] + j * kSegElems) * F, L_.seg_len(c, j) * F);
          sends++;
        }
      }
    }
    for (size_t k = 0; k < sends; k++)
      wait_send(g_, buf_.get(), right_);
  }

private:
  Gloo *g_;
  const Layout &L_;
  const uint64_t slot_;
  const int right_, left_;
  Buf buf_;
  Active active_;
};

/* ------------------------------------------------------------------------------------------ */
/* Recursive-doubling all-reduce                                                               */
/* ------------------------------------------------------------------------------------------ */

/* W a power of two. In step k rank r exchanges its whole partial sum with r ^ 2^k and adds the
 * two (received + own: the partner computes own + received, the same IEEE sum), so after
 * log2 W steps every rank holds bitwise the same total. The receive is posted before the send,
 * so both sides' data leave without waiting for a notification round trip; a segment of buf is
 * overwritten only once its send has completed (sends to one peer complete in order). */
void doubling_all_reduce(Gloo *g, float *buf, size_t n)
{
  const int W = g->world, r = g->rank;
  const uint64_t slot = gloo::Slot::build(kSlotAllReduce, g->seq++);
  if (g->scratch.size() < n)
    g->scratch.resize(n);
  float *tmp = g->scratch.data();
  auto &tctx = g->tctx;
  Buf own = tctx->createUnboundBuffer(buf, n * F);
  Buf got = tctx->createUnboundBuffer(tmp, n * F);
  Active active(g, {own.get(), got.get()});
  const size_t nseg = (n + kSegElems - 1) / kSegElems;
  for (int mask = 1; mask < W; mask <<= 1) {
    const int peer = r ^ mask;
    for (size_t j = 0; j < nseg; j++)
      got->recv(peer, slot, j * kSegElems * F, std::min(kSegElems, n - j * kSegElems) * F);
    for (size_t j = 0; j < nseg; j++)
      own->send(peer, slot, j * kSegElems * F, std::min(kSegElems, n - j * kSegElems) * F);
    for (size_t j = 0; j < nseg; j++) {
      const size_t o = j * kSegElems, len = std::min(kSegElems, n - o);
      wait_recv(g, got.get(), peer);
      wait_send(g, own.get(), peer);
      reduce_sum(buf + o, tmp + o, buf + o, len);
    }
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Backend entry points: collectives                                                           */
/* ------------------------------------------------------------------------------------------ */

void gloo_library_allreduce(Gloo *g, float *buf, size_t n)
{
  gloo::AllreduceOptions opts(g->ctx);
  opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  opts.setOutput(buf, n);
  opts.setReduceFunction(reduce_sum);
  opts.setTag(g->seq++);
  opts.setTimeout(g->timeout);
  gloo::allreduce(opts);
}

int gloo_all_reduce(void *impl, float *buf, size_t n, dt_comm_op_t op)
{
  Gloo *g = static_cast<Gloo *>(impl);
  return guarded(g, "all_reduce", [&]() -> int {
    const int W = g->world;
    if (W > 1 && g->gloo_allreduce) {
      gloo_library_allreduce(g, buf, n);
    } else if (W == 2 || (W > 2 && (W & (W - 1)) == 0 && n * F <= kDoublingMaxBytes)) {
      doubling_all_reduce(g, buf, n);
    } else if (W > 1) {
      /* Near-equal chunks, the first n % W one element longer. */
      std::vector<size_t> counts(W, n / W);
      for (size_t c = 0; c < n % W; c++)
        counts[c]++;
      Layout L(counts.data(), W);
      RingAllGather gather(g, buf, L);
      ring_reduce_scatter(g, buf, buf + L.off[g->rank], L, true);
      gather.run();
    }
    if (op == DT_COMM_AVG)
      scale_avg(buf, n, W);
    return 0;
  });
}

int gloo_reduce_scatter(void *impl, const float *in, float *out, const size_t *counts,
                        dt_comm_op_t op)
{
  Gloo *g = static_cast<Gloo *>(impl);
  return guarded(g, "reduce_scatter", [&]() -> int {
    if (g->world == 1) {
      if (counts[0])
        memmove(out, in, counts[0] * F);
    } else {
      ring_reduce_scatter(g, in, out, Layout(counts, g->world), false);
    }
    if (op == DT_COMM_AVG)
      scale_avg(out, counts[g->rank], g->world);
    return 0;
  });
}

int gloo_all_gather(void *impl, const float *in, float *out, const size_t *counts)
{
  Gloo *g = static_cast<Gloo *>(impl);
  return guarded(g, "all_gather", [&]() -> int {
    Layout L(counts, g->world);
    float *mine = out + L.off[g->rank];
    if (counts[g->rank] && in != mine)
      memmove(mine, in, counts[g->rank] * F);
    if (g->world > 1)
      RingAllGather(g, out, L).run();
    return 0;
  });
}

/* A pipelined chain root -> root+1 -> ... -> root-1: each rank forwards every segment as soon
 * as it arrives, so the time is about one transfer of n plus (world-2) segments. */
int gloo_broadcast(void *impl, float *buf, size_t n, int root)
{
  Gloo *g = static_cast<Gloo *>(impl);
  return guarded(g, "broadcast", [&]() -> int {
    const int W = g->world, r = g->rank;
    if (W == 1)
      return 0;
    const uint64_t slot = gloo::Slot::build(kSlotBroadcast, g->seq++);
    const int pos = (r - root + W) % W, next = (r + 1) % W, prev = (r + W - 1) % W;
    const bool last = pos == W - 1;
    const size_t nseg = (n + kSegElems - 1) / kSegElems;
    auto seg_len = [&](size_t j) { return std::min(kSegElems, n - j * kSegElems); };
    Buf b = g->tctx->createUnboundBuffer(buf, n * F);
    Active active(g, {b.get()});
    if (pos == 0) {
      for (size_t j = 0; j < nseg; j++)
        b->send(next, slot, j * kSegElems * F, seg_len(j) * F);
    } else {
      for (size_t j = 0; j < nseg; j++)
        b->recv(prev, slot, j * kSegElems * F, seg_len(j) * F);
      for (size_t j = 0; j < nseg; j++) {
        wait_recv(g, b.get(), prev);
        if (!last)
          b->send(next, slot, j * kSegElems * F, seg_len(j) * F);
      }
    }
    if (!last)
      for (size_t j = 0; j < nseg; j++)
        wait_send(g, b.get(), next);
    return 0;
  });
}

/* Dissemination barrier: in round k rank r signals r + 2^k and waits for r - 2^k; after
 * ceil(log2 W) rounds everyone has heard, directly or not, from everyone. Within one barrier a
 * direction of a pair carries at most one token, so one slot per barrier suffices. */
int gloo_barrier(void *impl)
{
  Gloo *g = static_cast<Gloo *>(impl);
  return guarded(g, "barrier", [&]() -> int {
    const int W = g->world, r = g->rank;
    if (W == 1)
      return 0;
    const uint64_t slot = gloo::Slot::build(kSlotBarrier, g->seq++);
    char tok_in = 0, tok_out = 1;
    Buf in = g->tctx->createUnboundBuffer(&tok_in, 1);
    Buf out = g->tctx->createUnboundBuffer(&tok_out, 1);
    Active active(g, {in.get(), out.get()});
    for (int d = 1; d < W; d <<= 1) {
      const int from = (r - d + W) % W, to = (r + d) % W;
      in->recv(from, slot);
      out->send(to, slot);
      wait_recv(g, in.get(), from);
      wait_send(g, out.get(), to);
    }
    return 0;
  });
}

/* ------------------------------------------------------------------------------------------ */
/* Backend entry points: point-to-point                                                        */
/* ------------------------------------------------------------------------------------------ */

/* Each transfer is the payload on the tag's slot, and on a header slot of its own, going the
 * other way, the size the receiver expects (uint64). The receiver posts its header and its
 * payload receive at once; the sender posts the payload once the header has arrived and
 * matches its size. So a mismatch fails both sides with an error (the sender names both sizes
 * and fails the context, which fails the receiver's wait) instead of a failed assertion on the
 * receiver's event-loop thread (a larger payload) or a short message taken for a whole one (a
 * smaller one), at the cost of one rendezvous per transfer. (Gloo moves a payload only once
 * the receive is posted at the other end. A size header from the sender, with the payload
 * receive posted only once that had arrived, cost a second rendezvous: two more one-way
 * trips, each waiting for a thread of the other process to be scheduled.) Every half is posted
 * at once; two messages on one (peer, tag) pair up in order, the headers on their slot as the
 * payloads on theirs. */
struct Half {
  uint64_t hdr; /* the size a receive expects, or the one a send was told */
  Buf hb, bb;   /* the header and the payload (declared after hdr: destroyed before it) */
  int peer;
};

/* Posts ops and waits for the sends. With pending, each receive is left in flight there (a
 * Half for gloo_p2p_wait), else waited for too. */
int p2p(Gloo *g, const dt_comm_p2p_t *ops, int n, void **pending)
{
  return guarded(g, "send/recv", [&]() -> int {
    auto &tctx = g->tctx;
    std::unique_ptr<Half> h[DT_COMM_P2P_MAX];
    std::vector<UnboundBuffer *> bufs;
    for (int i = 0; i < n; i++) {
      h[i].reset(new Half{ops[i].recv ? ops[i].bytes : 0, nullptr, nullptr, ops[i].peer});
      h[i]->hb = tctx->createUnboundBuffer(&h[i]->hdr, sizeof h[i]->hdr);
      h[i]->bb = tctx->createUnboundBuffer(ops[i].buf, ops[i].bytes);
      bufs.push_back(h[i]->hb.get());
      bufs.push_back(h[i]->bb.get());
    }
    Active active(g, bufs);
    auto slot = [&](uint8_t prefix, int i) {
      return gloo::Slot::build(prefix, (uint32_t)ops[i].tag);
    };
    for (int i = 0; i < n; i++) {
      if (ops[i].recv) {
        h[i]->hb->send(ops[i].peer, slot(kSlotP2PHeader, i));
        h[i]->bb->recv(ops[i].peer, slot(kSlotP2P, i));
      } else {
        h[i]->hb->recv(ops[i].peer, slot(kSlotP2PHeader, i));
      }
    }
    for (int i = 0; i < n; i++) {
      if (ops[i].recv)
        continue;
      wait_recv(g, h[i]->hb.get(), ops[i].peer);
      if (h[i]->hdr != ops[i].bytes) {
        DT_ERROR(COMM,
                 "comm %s rank %d/%d: send to rank %d (tag %d): it expects %llu bytes, this "
                 "rank sends %zu",
                 name_of(g).c_str(), g->rank, g->world, ops[i].peer, ops[i].tag,
                 (unsigned long long)h[i]->hdr, ops[i].bytes);
        return DT_ESHAPE;
      }
      h[i]->bb->send(ops[i].peer, slot(kSlotP2P, i));
    }
    for (int i = 0; i < n; i++) {
      if (!ops[i].recv) {
        wait_send(g, h[i]->bb.get(), ops[i].peer);
      } else if (!pending) {
        wait_send(g, h[i]->hb.get(), ops[i].peer);
        wait_recv(g, h[i]->bb.get(), ops[i].peer);
      }
    }
    for (int i = 0; i < n && pending; i++)
      pending[i] = ops[i].recv ? h[i].release() : nullptr;
    return 0;
  });
}

int gloo_p2p(void *impl, const dt_comm_p2p_t *ops, int n)
{
  return p2p(static_cast<Gloo *>(impl), ops, n, nullptr);
}

int gloo_p2p_post(void *impl, const dt_comm_p2p_t *ops, int n, void **pending)
{
  return p2p(static_cast<Gloo *>(impl), ops, n, pending);
}

/* A receive gloo_p2p_post left in flight: its header's send, then its payload. */
int gloo_p2p_wait(void *impl, void *pending, int drop)
{
  Gloo *g = static_cast<Gloo *>(impl);
  std::unique_ptr<Half> h(static_cast<Half *>(pending));
  if (drop)
    return 0;
  return guarded(g, "recv", [&]() -> int {
    Active active(g, {h->hb.get(), h->bb.get()});
    wait_send(g, h->hb.get(), h->peer);
    wait_recv(g, h->bb.get(), h->peer);
    return 0;
  });
}

void gloo_set_label(void *impl, const char *label)
{
  Gloo *g = static_cast<Gloo *>(impl);
  std::lock_guard<std::mutex> lock(g->name_mu);
  g->name = std::string(label) + " (" + g->prefix + ")";
}

} // namespace

/* No split entry (nullptr): comm.c splits by a child init sharing the parent's Gloo device. */
extern "C" const dt_comm_backend_t dt__comm_cpu_backend = {
    "cpu",           gloo_init,           gloo_destroy,    gloo_abort,
    gloo_all_reduce, gloo_reduce_scatter, gloo_all_gather, gloo_broadcast,
    gloo_p2p,        gloo_p2p_post,       gloo_p2p_wait,   gloo_barrier,
    nullptr,         0 /* host memory */, gloo_set_label,
};
