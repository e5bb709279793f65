// For sbt users only: set-up, tests and CI build the same jar without sbt
// (python -m spark_stretch.driver.shim compiles jvm_shim/ with the Scala compiler the pyspark wheel ships).
ThisBuild / scalaVersion := "2.13.18"
ThisBuild / organization := "io.github.spark-stretch"
ThisBuild / version      := "0.1.0"

lazy val shim = (project in file("jvm_shim"))
  .settings(
    name := "spark-stretch-shim",
    libraryDependencies ++= Seq(
      "org.apache.spark" %% "spark-sql" % "4.2.0" % Provided
    ),
    Compile / packageBin / artifactPath := target.value / "spark-stretch-shim.jar"
  )
