package policy

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// activations stands in for the control topic's latest policy activation.
type activations struct {
	mu    sync.Mutex
	label string
	hash  string // the content the activation pins, if any
}

func (a *activations) set(label string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.label = label
}

func (a *activations) active() (Activation, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return Activation{Label: a.label, ID: "1", Hash: a.hash}, a.label != ""
}

// follow runs WatchDir over dir and FollowActivations over root side by
// side, as the roles do, until the test ends.
func follow(t *testing.T, e *Engine, dir, root string, a *activations) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := e.WatchDir(ctx, dir, "local", time.Millisecond); err != nil {
			t.Errorf("WatchDir() = %v", err)
		}
	})
	wg.Go(func() {
		if err := e.FollowActivations(ctx, root, a.active, time.Millisecond); err != nil {
			t.Errorf("FollowActivations() = %v", err)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// holds checks that cond stays true for d, long enough for hundreds of
// the watchers' 1 ms polls.
func holds(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Millisecond) {
		if err := cond(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
}

func versionIs(e *Engine, label string) func() error {
	return func() error {
		if v := e.Active().Version(); !strings.HasPrefix(v, label+"@") {
			return fmt.Errorf("active version %q, want %s@…", v, label)
		}
		return nil
	}
}

// weatherVersions is a --policy-dir that allows get_weather and a
// versions root whose v2 forbids it, with the directory's set loaded.
func weatherVersions(t *testing.T) (dir, root string, base *Set) {
	t.Helper()
	dir, root = t.TempDir(), t.TempDir()
	writeFile(t, dir, "weather.cedar", allowWeather)
	writeFile(t, mkdir(t, root, "v2"), "weather.cedar", forbidWeather)
	base, err := LoadDir(dir, "local")
	if err != nil {
		t.Fatal(err)
	}
	return dir, root, base
}

// TestActivationWinsOverWatchedDir: a version activated on the control
// plane stays in force while the --policy-dir watcher runs beside it, even
// when the directory changes; once the activation is withdrawn, the
// directory's latest content is back in force.
func TestActivationWinsOverWatchedDir(t *testing.T) {
	dir, root, base := weatherVersions(t)
	logs := &ledgertest.LogBuffer{}
	e := newEngine(t, Config{Set: base, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	a := &activations{}
	follow(t, e, dir, root, a)

	a.set("v2")
	eventually(t, "v2 to be activated", func() bool { return versionIs(e, "v2")() == nil })
	holds(t, 300*time.Millisecond, "with the directory watched beside the activation", versionIs(e, "v2"))
	if d := e.Decide(context.Background(), simple("get_weather")); d.Allow || !strings.HasPrefix(d.Version, "v2@") {
		t.Errorf("Decide() under the activation = %+v; want denied by v2", d)
	}

	// The directory changes meanwhile: it is loaded, but waits.
	writeFile(t, dir, "zz_more.cedar", `@id("tickets") permit (principal, action == Action::"tool::create_ticket", resource);`)
	eventually(t, "the watcher to see the changed directory", func() bool {
		return strings.Contains(logs.String(), "an activated version is in force")
	})
	holds(t, 100*time.Millisecond, "after the directory changed", versionIs(e, "v2"))

	// Withdrawn (a tombstone on the control topic): the directory's
	// latest content is in force again.
	a.set("")
	eventually(t, "the directory's set to be back", func() bool {
		s := e.Active()
		return s != nil && s.Label() == "local" && s != base
	})
	if d := e.Decide(context.Background(), simple("create_ticket")); !d.Allow {
		t.Errorf("Decide(create_ticket) after the withdrawal = %+v; want allowed by the directory's latest set", d)
	}
}

// TestActivatedVersionThatDoesNotLoadFailsClosed: an activated version
// that does not load, or whose files are not the content the activation
// pins, denies every call (the previous set is no longer the operator's
// policy), is reported by Err and the logs, and is tried again until it
// loads.
func TestActivatedVersionThatDoesNotLoadFailsClosed(t *testing.T) {
	cases := []struct {
		name  string
		root  func(t *testing.T) string
		label string
		fix   func(t *testing.T, root string)
		hash  string // pinned by the activation
	}{
		{"broken files", func(t *testing.T) string {
			root := t.TempDir()
			writeFile(t, mkdir(t, root, "v3"), "weather.cedar", "permit (principal, action")
			return root
		}, "v3", func(t *testing.T, root string) {
			writeFile(t, filepath.Join(root, "v3"), "weather.cedar", forbidWeather)
		}, ""},
		{"missing version", tempDir, "v4", func(t *testing.T, root string) {
			writeFile(t, mkdir(t, root, "v4"), "weather.cedar", forbidWeather)
		}, ""},
		{"files other than the pinned content", func(t *testing.T) string {
			root := t.TempDir()
			writeFile(t, mkdir(t, root, "v7"), "weather.cedar", allowWeather)
			return root
		}, "v7", func(t *testing.T, root string) {
			writeFile(t, filepath.Join(root, "v7"), "weather.cedar", forbidWeather)
		}, hashOf(t, "weather.cedar", forbidWeather)},
		{"not a directory name", tempDir, "../v5", nil, ""},
		{"no versions directory", func(*testing.T) string { return "" }, "v6", nil, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir, root := t.TempDir(), tc.root(t)
			writeFile(t, dir, "weather.cedar", allowWeather)
			base, err := LoadDir(dir, "local")
			if err != nil {
				t.Fatal(err)
			}
			logs := &ledgertest.LogBuffer{}
			e := newEngine(t, Config{Set: base, Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err := e.Err(); err != nil {
				t.Fatalf("Err() before any activation = %v; want nil", err)
			}
			a := &activations{hash: tc.hash}
			follow(t, e, dir, root, a)
			a.set(tc.label)

			eventually(t, "the failed activation to deny", func() bool {
				return !e.Decide(context.Background(), simple("get_weather")).Allow
			})
			holds(t, 100*time.Millisecond, "while the activated version does not load", func() error {
				if d := e.Decide(context.Background(), simple("get_weather")); d.Allow || d.Reason != ReasonUnavailable {
					return fmt.Errorf("Decide() = %+v; want denied, %s", d, ReasonUnavailable)
				}
				return nil
			})
			if err := e.Err(); err == nil || !strings.Contains(err.Error(), tc.label) || !strings.Contains(err.Error(), tc.hash) {
				t.Errorf("Err() = %v; want the activated version %q named, and the hash it pins (%q)", err, tc.label, tc.hash)
			}
			if d := e.Decide(context.Background(), simple("get_weather")); !strings.Contains(d.Detail, tc.label) || (tc.hash != "") != strings.Contains(d.Detail, "not the content the activation pins") {
				t.Errorf("Decide().Detail = %q; want the activated version %q named, and whether its files are not the content pinned", d.Detail, tc.label)
			}
			if got := strings.Count(logs.String(), "activated policy version not in force"); got != 1 {
				t.Errorf("%d error logs for the failed activation; want 1 (retries are quiet):\n%s", got, logs.String())
			}
			if tc.fix == nil {
				return
			}
			tc.fix(t, root)
			eventually(t, "the fixed version to be loaded on a retry", func() bool { return versionIs(e, tc.label)() == nil })
			if err := e.Err(); err != nil {
				t.Errorf("Err() once the version loaded = %v; want nil", err)
			}
			if d := e.Decide(context.Background(), simple("get_weather")); d.Allow || d.Reason != ReasonDeniedByPolicy {
				t.Errorf("Decide() under the fixed version = %+v; want denied_by_policy", d)
			}
		})
	}
}

func tempDir(t *testing.T) string { return t.TempDir() }

// hashOf is the Set.Hash of a version whose one file is name with content.
func hashOf(t *testing.T, name, content string) string {
	t.Helper()
	dir := t.TempDir()
	writeFile(t, dir, name, content)
	s, err := LoadDir(dir, "any")
	if err != nil {
		t.Fatal(err)
	}
	return s.Hash()
}

// mkdir makes root/name and returns it.
func mkdir(t *testing.T, root, name string) string {
	t.Helper()
	d := filepath.Join(root, name)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestActivateAtOnce: Activate puts the activated version in force before
// it returns, so that a process that calls it before deciding its first
// call never decides with the set the activation replaced.
func TestActivateAtOnce(t *testing.T) {
	_, root, base := weatherVersions(t)
	e := newEngine(t, Config{Set: base})
	e.Activate(root, Activation{Label: "v2", ID: "1"}, true)
	if err := versionIs(e, "v2")(); err != nil {
		t.Fatal(err)
	}
	if d := e.Decide(context.Background(), simple("get_weather")); d.Allow {
		t.Errorf("Decide() right after Activate = %+v; want denied by v2", d)
	}
	e.Activate(root, Activation{}, false)
	if err := versionIs(e, "local")(); err != nil {
		t.Errorf("after the activation is withdrawn: %v", err)
	}
}

// An activation that does not load is read again at most every
// activationRetry, however often the engine is brought to it (an intake
// does at every step): its files are not read and parsed at every call
// for as long as it fails. Once that time has passed, the mended files
// load.
func TestFailedActivationIsNotReadAtEveryCall(t *testing.T) {
	_, root, base := weatherVersions(t)
	e := newEngine(t, Config{Set: base})
	v3 := mkdir(t, root, "v3")
	writeFile(t, v3, "broken.cedar", "permit (principal, actoin, resource);")
	a := Activation{Label: "v3", ID: "1"}
	e.Activate(root, a, true)
	if e.Err() == nil {
		t.Fatal("a version that does not parse is in force")
	}
	writeFile(t, v3, "broken.cedar", allowWeather)
	e.Activate(root, a, true)
	if e.Err() == nil {
		t.Errorf("the failed version was read again at once; want it read again after %s", activationRetry)
	}
	time.Sleep(activationRetry + 10*time.Millisecond)
	e.Activate(root, a, true)
	if err := versionIs(e, "v3")(); err != nil {
		t.Errorf("after %s: %v; want the mended version in force", activationRetry, err)
	}
}

// An operator who mended a version's files and activates it again gets
// the mended set: a new activation of a label reads its files again; the
// same activation, seen again at every tick, does not.
func TestActivatingALabelAgainRereadsIt(t *testing.T) {
	_, root, base := weatherVersions(t)
	e := newEngine(t, Config{Set: base})
	e.Activate(root, Activation{Label: "v2", ID: "1"}, true)
	first := e.Active().Version()
	if err := os.WriteFile(filepath.Join(root, "v2", "mended.cedar"), []byte(`@id("mended") permit (principal, action == Action::"tool::get_weather", resource);`), 0o644); err != nil {
		t.Fatal(err)
	}
	e.Activate(root, Activation{Label: "v2", ID: "1"}, true)
	if got := e.Active().Version(); got != first {
		t.Errorf("the same activation seen again: version %s; want %s, not read again", got, first)
	}
	e.Activate(root, Activation{Label: "v2", ID: "2"}, true)
	if got := e.Active().Version(); got == first || !strings.HasPrefix(got, "v2@") {
		t.Errorf("v2 activated again: version %s; want v2 with the mended files, not %s", got, first)
	}
}

// An activation's pin is part of what it is: the same label activated
// again with another pin, or none, even under the same ID, is followed,
// and activating it again without a pin drops the pin.
func TestActivationPinIsFollowed(t *testing.T) {
	_, root, base := weatherVersions(t)
	e := newEngine(t, Config{Set: base})
	v2 := hashOf(t, "weather.cedar", forbidWeather)
	other := hashOf(t, "weather.cedar", allowWeather)
	for _, step := range []struct {
		pin      string
		inForce  bool
		activate string
	}{
		{v2, true, "pinned to its files"},
		{other, false, "the same activation pinned to other content"},
		{"", true, "the same activation without a pin"},
		{other, false, "pinned to other content again"},
	} {
		e.Activate(root, Activation{Label: "v2", ID: "1", Hash: step.pin}, true)
		if err := versionIs(e, "v2")(); (err == nil) != step.inForce {
			t.Errorf("%s: %v; want v2 in force: %v", step.activate, err, step.inForce)
		}
	}
}

// Of two Syncs with the control topic's copy (a step's and a tick of
// FollowActivations, say), the one that applies last has read last: an
// activation read before a newer one was applied never replaces it.
// Before, the activation was read before the engine's lock was taken, so
// that a tick that had read v2, delayed, put it back in force over v3,
// activated since and already applied by a step.
func TestSyncNeverAppliesAnOlderRead(t *testing.T) {
	_, root, base := weatherVersions(t)
	writeFile(t, mkdir(t, root, "v3"), "weather.cedar", allowWeather)
	e := newEngine(t, Config{Set: base})
	var copyOf activations
	copyOf.set("v2")
	read, resume := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		// A tick that reads v2, then is held.
		e.Sync(root, func() (Activation, bool) {
			a, ok := copyOf.active()
			close(read)
			<-resume
			return a, ok
		})
	})
	<-read
	copyOf.set("v3")
	stepped := make(chan struct{})
	wg.Go(func() {
		defer close(stepped)
		e.Sync(root, copyOf.active)
	})
	// The step's Sync is applied now if the tick's read does not hold
	// the engine (it did not, before); either way the tick goes on after.
	select {
	case <-stepped:
	case <-time.After(200 * time.Millisecond):
	}
	close(resume)
	wg.Wait()
	if err := versionIs(e, "v3")(); err != nil {
		t.Errorf("after a tick's older read and a step's newer one: %v", err)
	}
}
