// Keras's callbacks for Model::fit, all of them: the interface and CallbackList (callback.h),
// ProgressBar (progress.h), ModelCheckpoint and BackupAndRestore (checkpoint_callbacks.h),
// TensorBoard and CSVLogger (logging_callbacks.h), EarlyStopping, TerminateOnNaN,
// LearningRateScheduler and LambdaCallback (control_callbacks.h), and preemption
// (preemption.h). Include this one, or the family you use.
#pragma once

#include "flotilla/train/callback.h"
#include "flotilla/train/checkpoint_callbacks.h"
#include "flotilla/train/control_callbacks.h"
#include "flotilla/train/logging_callbacks.h"
#include "flotilla/train/preemption.h"
#include "flotilla/train/progress.h"
