// The precompiled header's own translation unit (see pch.h); nothing else is in it.
