// dmlc ps-lite's key-value store measured on this machine, as a peer for
// bench_rows: one scheduler, one server and one worker (the role comes from
// DMLC_ROLE, as ps-lite's own tests start them; tests/bench/pslite.sh does).
//
//   pslite_kv dense1 N ROUNDS        N keys of one value each (ps-lite's own
//                                     benchmark, tests/test_kv_app_benchmark.cc)
//   pslite_kv dense N ROUNDS         one key of N values (how MXNet and BytePS
//                                     push a tensor)
//   pslite_kv rows DIM ROWS ROUNDS IDS   IDS distinct keys of DIM values each
//                                     (lens), from a working set of 20 x IDS
//                                     keys of a table of ROWS, made by a first
//                                     pass, as bench_rows draws them
//
// The server applies Adagrad (lr 0.01) to what it holds, as ps-server does
// to dense values and rows; a pull answers the values. Keys go sorted, as
// ps-lite requires. The worker prints one JSON line: the medians of the
// rounds' pull and push times (ms) and the values moved per request.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ps/ps.h"

namespace {

struct Store {
  std::string mode;
  size_t dim = 1;
  size_t rows = 0;
  float *w = nullptr, *acc = nullptr;  // rows x dim each, mapped zeroed (calloc)
};
Store store;

const float kLr = 0.01f, kEps = 1e-7f;

void Handle(const ps::KVMeta &meta, const ps::KVPairs<float> &req, ps::KVServer<float> *server) {
  const size_t n = req.keys.size();
  // dense: one key holds all the values; dense1 and rows: key k holds dim
  // values at k * dim.
  const bool one = store.mode == "dense";
  const size_t dim = one ? store.rows : store.dim;
  if (meta.push) {
    if (req.vals.size() != n * dim) {
      std::fprintf(stderr, "pslite_kv: push of %zu values for %zu keys of %zu\n", req.vals.size(),
                   n, dim);
      std::abort();
    }
    for (size_t i = 0; i < n; i++) {
      const size_t at = one ? 0 : static_cast<size_t>(req.keys[i]) * dim;
      float *w = store.w + at, *a = store.acc + at;
      const float *g = req.vals.data() + i * dim;
      for (size_t j = 0; j < dim; j++) {
        a[j] += g[j] * g[j];
        w[j] -= kLr * g[j] / (std::sqrt(a[j]) + kEps);
      }
    }
    server->Response(meta);
    return;
  }
  ps::KVPairs<float> res;
  res.keys = req.keys;
  res.vals.resize(n * dim);
  if (store.mode == "rows") res.lens.resize(n, static_cast<int>(dim));
  for (size_t i = 0; i < n; i++) {
    const size_t at = one ? 0 : static_cast<size_t>(req.keys[i]) * dim;
    std::memcpy(res.vals.data() + i * dim, store.w + at, dim * sizeof(float));
  }
  server->Response(meta, res);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void RunWorker(int rounds, size_t ids_n) {
  ps::KVWorker<float> kv(0, 0);
  const bool rows = store.mode == "rows";
  const size_t dim = store.mode == "dense" ? store.rows : store.dim;
  const size_t per = rows ? ids_n : store.mode == "dense" ? 1 : store.rows;
  // The working set (rows): 20 x IDS distinct keys spread over the table.
  const size_t W = rows ? std::min<size_t>(20 * ids_n, store.rows) : per;
  auto key_of = [&](size_t i) -> ps::Key {
    if (!rows) return static_cast<ps::Key>(i);
    return static_cast<ps::Key>((static_cast<unsigned long long>(i) * 7919ULL + 13) % store.rows);
  };
  ps::SArray<ps::Key> keys(per);
  ps::SArray<float> grad(per * dim);
  for (size_t i = 0; i < grad.size(); i++) grad[i] = 1e-3f * static_cast<float>(int(i % 11) - 5);
  ps::SArray<int> lens;
  if (rows) lens.resize(per, static_cast<int>(dim));
  auto fill = [&](size_t first) {
    for (size_t i = 0; i < per; i++) keys[i] = key_of((first + i) % W);
    std::sort(keys.begin(), keys.end());
  };
  // The first pass (rows made), untimed; then the rounds.
  for (size_t at = 0; at < W; at += per) {
    fill(at);
    ps::SArray<float> out;
    kv.Wait(kv.ZPush(keys, grad, lens));
    kv.Wait(kv.ZPull(keys, &out, rows ? &lens : nullptr));
  }
  std::vector<double> tp, tq;
  for (int r = 0; r < rounds; r++) {
    fill((static_cast<size_t>(r) * 7 * per + 3 * static_cast<size_t>(r)) % W);
    ps::SArray<float> out;
    ps::SArray<int> olens;
    auto t0 = std::chrono::steady_clock::now();
    kv.Wait(kv.ZPull(keys, &out, rows ? &olens : nullptr));
    auto t1 = std::chrono::steady_clock::now();
    kv.Wait(kv.ZPush(keys, grad, lens));
    auto t2 = std::chrono::steady_clock::now();
    if (out.size() != per * dim) {
      std::fprintf(stderr, "pslite_kv: pulled %zu values, not %zu\n", out.size(), per * dim);
      std::exit(1);
    }
    tp.push_back(Ms(t0, t1));
    tq.push_back(Ms(t1, t2));
  }
  std::printf("{\"mode\": \"%s\", \"keys\": %zu, \"values\": %zu, \"pull_ms\": %.4f, "
              "\"push_ms\": %.4f}\n",
              store.mode.c_str(), per, per * dim, Median(tp), Median(tq));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: pslite_kv dense1|dense N ROUNDS | pslite_kv rows DIM ROWS ROUNDS IDS\n");
    return 2;
  }
  store.mode = argv[1];
  int rounds;
  size_t ids_n = 0;
  if (store.mode == "rows") {
    if (argc < 6) return 2;
    store.dim = std::strtoul(argv[2], nullptr, 10);
    store.rows = std::strtoul(argv[3], nullptr, 10);
    rounds = std::atoi(argv[4]);
    ids_n = std::strtoul(argv[5], nullptr, 10);
  } else if (store.mode == "dense1" || store.mode == "dense") {
    store.rows = std::strtoul(argv[2], nullptr, 10);
    rounds = std::atoi(argv[3]);
  } else {
    std::fprintf(stderr, "pslite_kv: unknown mode '%s'\n", argv[1]);
    return 2;
  }
  if (rounds < 1 || store.rows < 1 || store.dim < 1 || (store.mode == "rows" && ids_n < 1)) {
    std::fprintf(stderr, "pslite_kv: bad sizes\n");
    return 2;
  }
  ps::Start(0);
  if (ps::IsServer()) {
    const size_t floats = store.mode == "dense" ? store.rows : store.rows * store.dim;
    store.w = static_cast<float *>(std::calloc(floats, sizeof(float)));
    store.acc = static_cast<float *>(std::calloc(floats, sizeof(float)));
    if (!store.w || !store.acc) {
      std::fprintf(stderr, "pslite_kv: out of memory\n");
      return 1;
    }
    auto server = new ps::KVServer<float>(0);
    server->set_request_handle(Handle);
    ps::RegisterExitCallback([server]() { delete server; });
  }
  if (ps::IsWorker()) RunWorker(rounds, ids_n);
  ps::Finalize(0, true);
  return 0;
}
