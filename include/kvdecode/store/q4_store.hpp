// Q4Store<T> and Q2Store<T>: the 4- and 2-bit KV caches, LowBitStore<T, 4> and <T, 2>.
#pragma once

#include "kvdecode/store/low_bit_store.hpp"
