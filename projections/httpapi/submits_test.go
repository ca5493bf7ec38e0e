package httpapi

import (
	"fmt"
	"testing"
	"time"
)

// Buckets full again are forgotten once there are many, and a forgotten
// bucket is a full one: tenants named once do not pile up, and nothing
// is given that a kept bucket would not give.
func TestSubmitBudgetForgetsFullBuckets(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	b := newSubmitBudget(10, 2, func() time.Time { return now })
	for i := range 3 * submitPruneFloor {
		if _, ok := b.take(fmt.Sprint("t", i)); !ok {
			t.Fatalf("tenant %d's first submission refused", i)
		}
		if len(b.buckets) > submitPruneFloor {
			t.Fatalf("%d buckets of tenants whose budgets were all full again", len(b.buckets))
		}
		now = now.Add(time.Millisecond) // 0.01 of a submission refilled
		if i%100 == 0 {
			now = now.Add(time.Second) // every bucket full again
		}
	}
	busy := "t_busy"
	for range 2 {
		if _, ok := b.take(busy); !ok {
			t.Fatal("a submission within the burst refused")
		}
	}
	b.prune(now)
	if d, ok := b.take(busy); ok || d <= 0 || d > 100*time.Millisecond {
		t.Fatalf("a third submission at once after a pruning = (%v, %v); want refused, within 100ms of the next (10/s)", d, ok)
	}
	if _, ok := b.buckets[busy]; !ok {
		t.Fatal("the pruning forgot a bucket that was not full")
	}
	if newSubmitBudget(0, 5, time.Now) != nil || newSubmitBudget(-1, 5, time.Now) != nil {
		t.Fatal("a rate of 0 or less bounds something")
	}
}

// The clock is read under the budget's lock, so that the buckets see
// their times in order: a time read before the lock could reach a bucket
// after a later one, move its clock back, and the span in between be
// refilled twice, giving a flood more than the rate.
func TestSubmitBudgetReadsTheClockUnderItsLock(t *testing.T) {
	var b *submitBudget
	now := time.Unix(1_700_000_000, 0)
	b = newSubmitBudget(10, 2, func() time.Time {
		if b.mu.TryLock() {
			b.mu.Unlock()
			t.Error("the clock was read outside the budget's lock")
		}
		return now
	})
	b.take("t_a")
}
