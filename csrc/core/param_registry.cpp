#include "core/param_registry.h"

#include "core/check.h"

namespace dsz {

bool ParamRegistry::put(ParamEntry entry)
{
    const int64_t id = entry.ds_id;
    auto it = params_.find(id);
    if (it == params_.end()) {
        params_.emplace(id, std::move(entry));
        return false;
    }
    it->second = std::move(entry);
    return true;
}

ParamEntry& ParamRegistry::get(int64_t ds_id, const char* op)
{
    auto it = params_.find(ds_id);
    DSZ_CHECK(it != params_.end(), op, "unknown ds_id ", ds_id,
              " (not registered with register_z3_param/register_param since init(); ",
              params_.size(), " params registered)");
    return it->second;
}

const ParamEntry& ParamRegistry::get(int64_t ds_id, const char* op) const
{
    return const_cast<ParamRegistry*>(this)->get(ds_id, op);
}

int64_t ParamRegistry::reducibleSlotNumel() const
{
    int64_t n = 0;
    for (const auto& [id, p] : params_) {
        if (!p.frozen) { n += p.slotNumel(); }
    }
    return n;
}

}  // namespace dsz
