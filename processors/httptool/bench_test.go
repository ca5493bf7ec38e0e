package httptool

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkCall measures calls on kept-alive connections to a tool that
// answers at once, the client's and the (in-process) server's work
// together: compare builds side by side (benchstat), not against a number.
//
//	go test -run '^$' -bench Call -benchmem -count 10 ./processors/httptool/
func BenchmarkCall(b *testing.B) {
	answer := []byte(`{"ticket_id":"T-1","status":"open"}`)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	}))
	defer ts.Close()
	c := New(Config{})
	r := request(ts.URL + "/tools/create_ticket")
	// A credential of the usual length, so that its checks cost what
	// they do in a deployment.
	r.Credential = strings.Repeat("a", 600)
	// Without a gate, and with one (the executor's kill switch, asked
	// once the connection is ready), side by side.
	for _, bc := range []struct {
		name string
		gate func() error
	}{{"plain", nil}, {"gated", func() error { return nil }}} {
		b.Run(bc.name, func(b *testing.B) {
			r := r
			r.Gate = bc.gate
			b.ReportAllocs()
			// Several calls in flight, as in an executor under load, so
			// that the time per call is the CPU's, not a round trip's
			// wait.
			b.SetParallelism(8)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := c.Call(b.Context(), r); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
