package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"
)

// The bench's backend reads every process's keys at once: a process that
// holds its answer (stopped mid-answer) leaves out its own keys only, not
// those of the processes listed after it; none answering is an error.
func TestKeySetsAHangingProcessHoldsBackNoOther(t *testing.T) {
	release := make(chan struct{})
	hanging := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); hanging.Close() })
	answering := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`{"keys":[{"kid":"a"}]}`))
	}))
	t.Cleanup(answering.Close)

	b, err := keySets(t.Context(), http.DefaultClient, []string{hanging.URL, answering.URL}, 200*time.Millisecond)
	var set struct {
		Keys []struct{ Kid string } `json:"keys"`
	}
	var kids []string
	if err == nil && json.Unmarshal(b, &set) == nil {
		for _, k := range set.Keys {
			kids = append(kids, k.Kid)
		}
	}
	if err != nil || !slices.Equal(kids, []string{"a"}) {
		t.Fatalf("keySets(hanging, answering) = %s, %v; want the answering process's key a", b, err)
	}
	if _, err := keySets(t.Context(), http.DefaultClient, []string{hanging.URL}, 100*time.Millisecond); err == nil {
		t.Error("keySets(hanging) answered; want an error, no process answering")
	}
}
