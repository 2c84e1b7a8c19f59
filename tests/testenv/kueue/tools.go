//go:build tools

// Package tools records the Kueue manager this module builds so `go mod tidy`
// keeps its dependencies. Kueue pins its own k8s.io/* and controller-runtime
// versions; this module takes them as they are (no replace block).
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
