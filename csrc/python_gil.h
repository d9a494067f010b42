// The extension's rule for the GIL: never block, on the runtime's lock or on a collective, while
// holding it. A thread that holds the runtime's lock may need the GIL (to come back from a
// collective it waited on without it), and gloo's worker may need it (to drop a finished work's
// Python-owned tensor). Bindings release it at entry; op kernels hold it only when the Python
// dispatcher called them (torch.compile, DeepCompile's profiler) and release it here.
#pragma once

#include <Python.h>

namespace dsz {

class GilReleasedIfHeld {
public:
    GilReleasedIfHeld()
        : saved_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr)
    {
    }
    ~GilReleasedIfHeld()
    {
        if (saved_ != nullptr) { PyEval_RestoreThread(saved_); }
    }
    GilReleasedIfHeld(const GilReleasedIfHeld&) = delete;
    GilReleasedIfHeld& operator=(const GilReleasedIfHeld&) = delete;

private:
    PyThreadState* saved_;  // the GIL's state this thread gave up, or null
};

}  // namespace dsz
