// The routing cases the GPU suites share: a routing, optional unused slots and signed router
// weights, with or without a shared expert, on the tiny preset's shape (or a given one).
#pragma once

#include <ostream>
#include <string>

#include "mok/synthetic.hpp"

namespace mok::testing {

struct Case {
  std::string routing;  // as Routing::parse reads it
  double unused_slots;
  bool signed_weights;
  bool shared_expert;
};

// How gtest names a case in its output (instead of the raw bytes of the struct).
inline void PrintTo(const Case& which, std::ostream* out) {
  *out << which.routing << (which.unused_slots > 0 ? ", unused slots" : "")
       << (which.signed_weights ? ", signed weights" : "")
       << (which.shared_expert ? ", shared expert" : "");
}

// A test name: "skewed_1_5_signed_shared".
inline std::string case_name(const Case& which) {
  std::string name = which.routing + (which.unused_slots > 0 ? "_unused" : "") +
                     (which.signed_weights ? "_signed" : "") +
                     (which.shared_expert ? "_shared" : "");
  for (char& c : name)
    if (c == ':' || c == '-' || c == '.') c = '_';
  return name;
}

// `shape` defaults to the tiny preset (H 256, I 128, I_s 128, E 16, top-4); without a shared
// expert in the case, I_s becomes 0.
inline Problem make_problem(const Case& which, int64_t num_tokens, uint64_t seed,
                            LayerShape shape = find_preset("tiny").shape) {
  SyntheticSpec spec;
  spec.shape = shape;
  if (!which.shared_expert) spec.shape.shared_intermediate = 0;
  spec.num_tokens = num_tokens;
  spec.routing = Routing::parse(which.routing);
  spec.seed = seed;
  spec.signed_router_weights = which.signed_weights;
  spec.unused_slot_fraction = which.unused_slots;
  return Problem::generate(spec);
}

}  // namespace mok::testing
