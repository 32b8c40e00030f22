// Sampling parameters (common/sampling_params.h) on the wire (Generate and
// Prefill carry them): one mapping, so that the router, the decode worker and the prefill
// worker sample a request the same way.
#pragma once

#include "common/proto/pdserve.pb.h"
#include "common/sampling_params.h"

namespace pdserve {

void ToProto(const SamplingParams& s, proto::SamplingParams* p);
// Unset knobs (top_p 0, top_k 0) come back as "off".
SamplingParams FromProto(const proto::SamplingParams& p);

}  // namespace pdserve
