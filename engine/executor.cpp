#include "engine/executor.h"

namespace pdserve {

StatusOr<std::unique_ptr<Executor>> Executor::Create(Model* model, KvCachePool* pool,
                                                     const RunnerOptions& options) {
  auto runner = ModelRunner::Create(model, pool->layout(), pool->base(), options);
  if (!runner.ok()) return runner.status();
  std::unique_ptr<Executor> e(new Executor());
  e->backend_ = model->backend();
  e->runner_ = std::move(*runner);
  return e;
}

}  // namespace pdserve
