package ledgertest

import (
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// NewInProcess is New on the in-process cluster, whatever cluster
// LEDGER_TEST_KAFKA_BROKERS names: for tests that inject broker faults
// through Cluster. It sets the variable for t, so t must not be parallel.
func NewInProcess(t *testing.T, o Options) *Kafka {
	t.Helper()
	t.Setenv("LEDGER_TEST_KAFKA_BROKERS", "")
	return New(t, o)
}

// StallFetches holds every fetch the in-process cluster c receives until
// release is called (or the test ends), as a consumer whose connection
// wedged. Every fetch: within a fetch session, a request need not name
// the topics it reads. It returns once a fetch is held, so that none is
// in flight: a record produced then is not read until release.
func StallFetches(t testing.TB, c *kfake.Cluster) (release func()) {
	t.Helper()
	released, held := make(chan struct{}), make(chan struct{})
	var releaseOnce, heldOnce sync.Once
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		select {
		case <-released:
			c.DropControl()
			return nil, nil, false
		default:
		}
		c.KeepControl()
		heldOnce.Do(func() { close(held) })
		c.SleepControl(func() { <-released })
		return nil, nil, false
	})
	release = func() { releaseOnce.Do(func() { close(released) }) }
	t.Cleanup(release)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("no fetch held after 30s")
	}
	return release
}
